"""Qwen3's per-head RMSNorm of q and k followed by neox RoPE, in place, in one launch: the three
separate kernels cost more in launch latency than in memory traffic at decode sizes."""

import torch
import triton
import triton.language as tl

from ostinato.kernels.dispatch import jit, use_triton
from ostinato.kernels.norm import rms_norm_torch
from ostinato.kernels.rope import rotary_torch


def qk_norm_rope(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], may be a strided view
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim], may be a strided view
    q_weight: torch.Tensor,  # [head_dim]
    k_weight: torch.Tensor,  # [head_dim]
    eps: float,
    positions: torch.Tensor,  # int64 [num_tokens]
    cos_sin_cache: torch.Tensor,  # float32 [max_position, head_dim]: cos | sin halves
) -> None:
    if use_triton(q):
        return _qk_norm_rope_triton(q, k, q_weight, k_weight, eps, positions, cos_sin_cache)
    return qk_norm_rope_torch(q, k, q_weight, k_weight, eps, positions, cos_sin_cache)


def qk_norm_rope_torch(q, k, q_weight, k_weight, eps, positions, cos_sin_cache) -> None:
    """The unfused sequence, so the CPU path stays bit-identical to norm -> norm -> rotary."""
    q.copy_(rms_norm_torch(q, q_weight, eps))
    k.copy_(rms_norm_torch(k, k_weight, eps))
    rotary_torch(q, k, positions, cos_sin_cache)


@jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, pos_ptr, cache_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    HEADS_P2: tl.constexpr, HALF_P2: tl.constexpr,
):  # fmt: skip
    """One token per program, all its q and k heads in one [heads, half] tile per half (as in
    rope.py), so the cos/sin row and both weights are read once per token."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token)
    d = tl.arange(0, HALF_P2)
    h = tl.arange(0, HEADS_P2)
    d_ok = d < HALF
    is_q = h < NUM_HEADS
    is_k = (h >= NUM_HEADS) & (h < NUM_HEADS + KV_HEADS)
    q_off = token * stride_qt + h * stride_qh
    k_off = token * stride_kt + (h - NUM_HEADS) * stride_kh
    ptr = tl.where(is_q, q_ptr + q_off, k_ptr + k_off)[:, None] + d[None, :]
    mask = (is_q | is_k)[:, None] & d_ok[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    rstd = tl.rsqrt(ss / (2 * HALF) + eps)[:, None]
    q_row = is_q[:, None]
    w1 = tl.where(
        q_row,
        tl.load(q_weight_ptr + d, mask=d_ok)[None, :],
        tl.load(k_weight_ptr + d, mask=d_ok)[None, :],
    ).to(tl.float32)
    w2 = tl.where(
        q_row,
        tl.load(q_weight_ptr + HALF + d, mask=d_ok)[None, :],
        tl.load(k_weight_ptr + HALF + d, mask=d_ok)[None, :],
    ).to(tl.float32)
    dtype = ptr.dtype.element_ty
    # the normalised values round to the tensor dtype before rotating, as the unfused norm
    # stored them, so the result matches the torch reference's rounding
    y1 = (x1 * rstd * w1).to(dtype).to(tl.float32)
    y2 = (x2 * rstd * w2).to(dtype).to(tl.float32)
    row = cache_ptr + pos * stride_cache
    cos = tl.load(row + d, mask=d_ok)[None, :]
    sin = tl.load(row + HALF + d, mask=d_ok)[None, :]
    tl.store(ptr, (y1 * cos - y2 * sin).to(dtype), mask=mask)
    tl.store(ptr + HALF, (y2 * cos + y1 * sin).to(dtype), mask=mask)


def _qk_norm_rope_triton(q, k, q_weight, k_weight, eps, positions, cos_sin_cache) -> None:
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    assert q.dtype == k.dtype and q.stride(2) == k.stride(2) == cos_sin_cache.stride(1) == 1
    assert q_weight.is_contiguous() and k_weight.is_contiguous()
    kv_heads = k.shape[1]
    heads_p2 = triton.next_power_of_2(num_heads + kv_heads)
    half_p2 = triton.next_power_of_2(head_dim // 2)
    _qk_norm_rope_kernel[(num_tokens,)](
        q, k, q_weight, k_weight, positions, cos_sin_cache, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_HEADS=num_heads, KV_HEADS=kv_heads, HALF=head_dim // 2,
        HEADS_P2=heads_p2, HALF_P2=half_p2,
        # about 16 elements of each half per thread, so wide models (64 + 8 heads) do not spill
        num_warps=min(16, max(4, heads_p2 * half_p2 // 512)),
    )  # fmt: skip
