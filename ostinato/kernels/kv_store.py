"""Write this step's keys and values into the paged cache."""

import torch
import triton
import triton.language as tl

from ostinato.kernels.dispatch import jit, use_triton


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


@jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    e = tl.arange(0, BLOCK)
    head, d = e // HEAD_DIM, e % HEAD_DIM
    mask = e < KV_HEADS * HEAD_DIM
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + head * stride_ch + d
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def _store_kv_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert (
        k_cache.stride() == v_cache.stride()
        and k_cache.stride(3) == k.stride(2) == v.stride(2) == 1
    )
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK=triton.next_power_of_2(kv_heads * head_dim),
    )  # fmt: skip
