"""Rotary position embedding, neox style (rotate halves), in place on q and k."""

import torch

from ostinato.kernels.dispatch import use_triton


def rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    positions: torch.Tensor,  # int64 [num_tokens]
    cos_sin_cache: torch.Tensor,  # float32 [max_position, head_dim]: cos | sin halves
) -> None:
    if use_triton(q):
        return _rotary_triton(q, k, positions, cos_sin_cache)
    return rotary_torch(q, k, positions, cos_sin_cache)


def rotary_torch(q, k, positions, cos_sin_cache) -> None:
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    for t in (q, k):
        x1, x2 = t.float().chunk(2, dim=-1)
        t.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def _rotary_triton(q, k, positions, cos_sin_cache):
    raise NotImplementedError("Triton rotary is being written (kernels issue)")
