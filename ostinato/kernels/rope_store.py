"""Neox RoPE on q and k, optionally after Qwen3's per-head RMSNorm, and the store of k and v into
the paged KV cache, in one launch. At decode sizes each separate kernel costs more in launch
latency than in memory traffic, and the store runs here, inside a captured segment, rather
than in the attention call that PIECEWISE graphs run eagerly."""

import torch
import triton
import triton.language as tl

from ostinato.kernels.dispatch import interpreting, jit, pdl_options, use_triton
from ostinato.kernels.kv_store import store_kv_torch
from ostinato.kernels.launch import Launch
from ostinato.kernels.norm import rms_norm_torch


def rope_and_store(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], may be a strided view
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim], may be a strided view
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim], may be a strided view
    positions: torch.Tensor,  # int64 [num_tokens]
    cos_sin_cache: torch.Tensor,  # float32 [max_position, head_dim]: cos | sin halves
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]; slot = block * block_size + offset; -1 skipped
    q_weight: torch.Tensor | None = None,  # [head_dim]: RMSNorm q and k per head first
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    step: dict | None = None,
) -> None:
    """In place: q = rope(norm(q)), k = rope(norm(k)) (norm only with weights); then k and v
    are written to the cache at each token's slot. `step`: a dict the calls of one forward
    step share (ForwardContext.rope), whose layers pass one cos|sin table, caches of one
    allocation and norm weights of one layout: there the launch is found by what each
    layer's q, k and v may change alone (the whole key costs ~4 µs more a layer)."""
    if use_triton(q):
        return _rope_and_store_triton(
            q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
            q_weight, k_weight, eps, step,
        )  # fmt: skip
    return rope_and_store_torch(
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q_weight, k_weight, eps
    )


def rope_and_store_torch(
    q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
    q_weight=None, k_weight=None, eps=0.0,
) -> None:  # fmt: skip
    """The unfused sequence: norm -> norm -> rotary -> store."""
    if q_weight is not None:
        q.copy_(rms_norm_torch(q, q_weight, eps))
        k.copy_(rms_norm_torch(k, k_weight, eps))
    rotary_torch(q, k, positions, cos_sin_cache)
    store_kv_torch(k, v, k_cache, v_cache, slot_mapping)


def rotary_torch(q, k, positions, cos_sin_cache) -> None:
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    for t in (q, k):
        x1, x2 = t.float().chunk(2, dim=-1)
        t.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


@jit
def _rope_and_store_kernel(
    q_ptr, k_ptr, v_ptr, q_weight_ptr, k_weight_ptr, pos_ptr, cache_ptr, slot_ptr,
    k_cache_ptr, v_cache_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cache,
    stride_cb, stride_cs, stride_ch,
    NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
    HEADS_P2: tl.constexpr, KV_P2: tl.constexpr, HALF_P2: tl.constexpr, NORM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One token per program: its q and k heads form one [heads, half] tile per half, so the
    cos/sin row and the norm weights are read once per token; v is copied as one tile."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    d = tl.arange(0, HALF_P2)
    h = tl.arange(0, HEADS_P2)
    d_ok = d < HALF
    is_q = h < NUM_HEADS
    is_k = (h >= NUM_HEADS) & (h < NUM_HEADS + KV_HEADS)
    kv_h = h - NUM_HEADS
    q_off = token * stride_qt + h * stride_qh
    k_off = token * stride_kt + kv_h * stride_kh
    # q heads and k heads share one tile; each row takes its own pointer
    ptr = tl.where(is_q, q_ptr + q_off, k_ptr + k_off)[:, None] + d[None, :]
    mask = (is_q | is_k)[:, None] & d_ok[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = ptr.dtype.element_ty
    if NORM:
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
        # the normalised values round to the tensor dtype before rotating, as the unfused
        # norm stored them, so the result matches the torch reference's rounding
        x1 = (x1 * rstd * w1).to(dtype).to(tl.float32)
        x2 = (x2 * rstd * w2).to(dtype).to(tl.float32)
    row = cache_ptr + pos * stride_cache
    cos = tl.load(row + d, mask=d_ok)[None, :]
    sin = tl.load(row + HALF + d, mask=d_ok)[None, :]
    y1 = (x1 * cos - x2 * sin).to(dtype)
    y2 = (x2 * cos + x1 * sin).to(dtype)
    tl.store(ptr, y1, mask=mask)
    tl.store(ptr + HALF, y2, mask=mask)
    if slot >= 0:
        dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
        k_dst = k_cache_ptr + dst + kv_h[:, None] * stride_ch + d[None, :]
        k_mask = is_k[:, None] & d_ok[None, :]
        tl.store(k_dst, y1, mask=k_mask)
        tl.store(k_dst + HALF, y2, mask=k_mask)
        vh = tl.arange(0, KV_P2)
        dv = tl.arange(0, 2 * HALF_P2)
        v_mask = (vh < KV_HEADS)[:, None] & (dv < 2 * HALF)[None, :]
        v_row = tl.load(
            v_ptr + token * stride_vt + vh[:, None] * stride_vh + dv[None, :], mask=v_mask
        )
        tl.store(v_cache_ptr + dst + vh[:, None] * stride_ch + dv[None, :], v_row, mask=v_mask)


def _rope_and_store_triton(
    q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q_weight, k_weight, eps,
    step=None,
) -> None:  # fmt: skip
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    norm = q_weight is not None
    if step is None:
        launch = _launch_for(q, k, v, cos_sin_cache, k_cache, v_cache, q_weight, k_weight, eps)
    else:
        layer = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), norm, eps)
        launch = step.get(layer)
        if launch is None:
            launch = step[layer] = _launch_for(
                q, k, v, cos_sin_cache, k_cache, v_cache, q_weight, k_weight, eps
            )
    launch.run(
        (num_tokens, 1, 1), q, k, v, q_weight if norm else q, k_weight if norm else q, positions,
        cos_sin_cache, slot_mapping, k_cache, v_cache,
    )  # fmt: skip


def _launch_for(q, k, v, cos_sin_cache, k_cache, v_cache, q_weight, k_weight, eps) -> Launch:
    norm = q_weight is not None
    # shapes and whole stride tuples: what the checks and the launch read of them, so both
    # run once per key (an eager step calls this once a layer)
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), k_cache.shape, k_cache.stride(),
           v_cache.stride(), cos_sin_cache.stride(), q.dtype, k.dtype, v.dtype, k_cache.dtype,
           norm and (q_weight.stride(), k_weight.stride()), eps, interpreting())  # fmt: skip
    launch = _launches.get(key)
    if launch is None:
        launch = _launches[key] = _rope_launch(q, k, v, cos_sin_cache, k_cache, v_cache, q_weight,
                                               k_weight, eps)  # fmt: skip
    return launch


def _rope_launch(q, k, v, cos_sin_cache, k_cache, v_cache, q_weight, k_weight, eps) -> Launch:
    num_tokens, num_heads, head_dim = q.shape
    assert q.dtype == k.dtype == v.dtype == k_cache.dtype and k_cache.stride() == v_cache.stride()
    assert q.stride(2) == k.stride(2) == v.stride(2) == k_cache.stride(3) == 1
    assert cos_sin_cache.stride(1) == 1
    norm = q_weight is not None
    if norm:
        assert q_weight.is_contiguous() and k_weight.is_contiguous()
    kv_heads = k.shape[1]
    tail = (
        eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
    )  # fmt: skip
    heads_p2 = triton.next_power_of_2(num_heads + kv_heads)
    half_p2 = triton.next_power_of_2(head_dim // 2)
    pdl = pdl_options()
    return Launch(
        _rope_and_store_kernel, (num_tokens, 1, 1), num_head=10, tail=tail,
        constexprs=dict(
            NUM_HEADS=num_heads, KV_HEADS=kv_heads, HALF=head_dim // 2, PAGE=k_cache.shape[1],
            HEADS_P2=heads_p2, KV_P2=triton.next_power_of_2(kv_heads), HALF_P2=half_p2,
            NORM=norm, PDL=pdl["PDL"],
        ),
        # about 16 elements of each half per thread, so wide models (64 + 8 heads) do not
        # spill
        num_warps=min(16, max(4, heads_p2 * half_p2 // 512)), launch_pdl=pdl["launch_pdl"],
    )  # fmt: skip


_launches: dict[tuple, Launch] = {}  # eager calls skip Triton's Python launch path
