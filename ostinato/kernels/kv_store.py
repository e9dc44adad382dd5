"""Write this step's keys and values into the paged cache."""

import torch

from ostinato.kernels.dispatch import use_triton


def store_kv(
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]; slot = block * block_size + offset; -1 skipped
) -> None:
    if use_triton(k):
        return _store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return store_kv_torch(k, v, k_cache, v_cache, slot_mapping)


def store_kv_torch(k, v, k_cache, v_cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def _store_kv_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    raise NotImplementedError("Triton store_kv is being written (kernels issue)")
