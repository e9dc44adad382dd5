"""Rotary position embedding, neox style (rotate halves), in place on q and k."""

import torch
import triton
import triton.language as tl

from ostinato.kernels.dispatch import jit, use_triton


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


@jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    HEADS_P2: tl.constexpr, HALF_P2: tl.constexpr,
):  # fmt: skip
    """One token per program: its cos/sin row is read once for all q and k heads."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token)
    d = tl.arange(0, HALF_P2)
    h = tl.arange(0, HEADS_P2)
    row = cache_ptr + pos * stride_cache
    cos = tl.load(row + d, mask=d < HALF)[None, :]
    sin = tl.load(row + HALF + d, mask=d < HALF)[None, :]
    is_q = h < NUM_HEADS
    is_k = (h >= NUM_HEADS) & (h < NUM_HEADS + KV_HEADS)
    q_off = token * stride_qt + h * stride_qh
    k_off = token * stride_kt + (h - NUM_HEADS) * stride_kh
    # q heads and k heads share one [heads, half] tile; each lane takes its own pointer
    ptr = tl.where(is_q, q_ptr + q_off, k_ptr + k_off)[:, None] + d[None, :]
    mask = (is_q | is_k)[:, None] & (d < HALF)[None, :]
    x1 = tl.load(ptr, mask=mask).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask).to(tl.float32)
    tl.store(ptr, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(ptr + HALF, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


def _rotary_triton(q, k, positions, cos_sin_cache) -> None:
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    assert q.dtype == k.dtype and q.stride(2) == k.stride(2) == cos_sin_cache.stride(1) == 1
    kv_heads = k.shape[1]
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_HEADS=num_heads, KV_HEADS=kv_heads, HALF=head_dim // 2,
        HEADS_P2=triton.next_power_of_2(num_heads + kv_heads),
        HALF_P2=triton.next_power_of_2(head_dim // 2),
    )  # fmt: skip
