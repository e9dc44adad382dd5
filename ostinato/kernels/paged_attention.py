"""Causal attention over a paged KV cache for any mix of prefill chunks and decodes."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ostinato.kernels.dispatch import jit, num_sms, pdl_options, use_triton
from ostinato.kernels.launch import Launch


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # like q, written in place
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor,  # int32 [num_reqs]
    block_table: torch.Tensor,  # int32 [num_reqs, max_blocks]
    scale: float,
) -> None:
    """One call. Layers of a step share a PagedAttention instead (built once, launched per
    layer)."""
    if use_triton(q):
        attention = PagedAttention(q, out, k_cache, query_start_loc, seq_lens, block_table, scale)
        return attention(q, k_cache, v_cache, out)
    return paged_attention_torch(
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, scale
    )


def paged_attention_torch(
    q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, scale
) -> None:
    """Reference: a host loop over requests (reads lengths on the host; never graph-captured)."""
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        if q_end == q_start:
            continue
        blocks = block_table[i, : -(-seq_len // block_size)].long()
        keys = k_cache[blocks].flatten(0, 1)[:seq_len]
        values = v_cache[blocks].flatten(0, 1)[:seq_len]
        out[q_start:q_end] = causal_attention(q[q_start:q_end], keys, values, scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """q [n, H, D] are the last n positions of a sequence whose keys are k [s, KH, D]."""
    n, s = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    mask = torch.ones(n, s, dtype=torch.bool, device=q.device).tril(diagonal=s - n)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return o.transpose(0, 1)


@jit
def _attend_tile(
    acc, m_i, l_i, q, k_base, v_base, bt_row, start, kv_hi, pos, qk_scale, stride_cb, stride_cs,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, MASKED: tl.constexpr,
    PRECISION: tl.constexpr, DIRECT: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over KV positions [start, start + BLOCK_N). Unmasked tiles lie
    wholly before every row's position and before kv_hi: no bounds or causal checks. DIRECT:
    the positions are this step's tokens, position n at row n of k_base / v_base (stride_cs
    apart), read without the block table."""
    n = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    in_range = n < kv_hi
    if DIRECT:
        offs = n.to(tl.int64) * stride_cs
    else:
        if MASKED:
            page = tl.load(bt_row + n // PAGE, mask=in_range, other=0)
        else:
            page = tl.load(bt_row + n // PAGE)
        offs = page.to(tl.int64) * stride_cb + (n % PAGE) * stride_cs
    if MASKED:
        k = tl.load(k_base + offs[None, :] + d[:, None], mask=in_range[None, :], other=0.0)
        v = tl.load(v_base + offs[:, None] + d[None, :], mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(k_base + offs[None, :] + d[:, None])
        v = tl.load(v_base + offs[:, None] + d[None, :])
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
    if MASKED:
        s = tl.where((n[None, :] <= pos[:, None]) & in_range[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@jit
def _rotated(rows, mask, cols, partner, w, w_partner, cos, sin, eps, HEAD_DIM: tl.constexpr,
             NORM: tl.constexpr):  # fmt: skip
    """Head vectors at rows [R, 1] (pointers), rotated by neox RoPE after the per-head RMSNorm
    (weights w at cols, w_partner at the partner elements) with NORM, in their dtype: as
    kernels/rope_store.py rounds, the normalised values before rotating."""
    x = tl.load(rows + cols, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(rows + partner, mask=mask, other=0.0).to(tl.float32)
    dtype = rows.dtype.element_ty
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        x = (x * rstd * w).to(dtype).to(tl.float32)
        x_partner = (x_partner * rstd * w_partner).to(dtype).to(tl.float32)
    return (x * cos + x_partner * sin).to(dtype)


@jit(do_not_specialize=["num_reqs"])  # no compiled variant per batch size
def _attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, k_ptr, v_ptr, q_norm_ptr, k_norm_ptr,
    part_ptr, m_ptr, l_ptr, live_ptr, count_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr, cos_sin_ptr, slot_ptr,
    qk_scale, eps, num_reqs,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    stride_kt, stride_kh, stride_cos, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    SPLIT: tl.constexpr, MERGE: tl.constexpr, REQ_CHUNK: tl.constexpr, PRECISION: tl.constexpr,
    DIRECT: tl.constexpr, DIRECT_STAGES: tl.constexpr, ROPE: tl.constexpr, NORM_QK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Grid (tile, kv_head, split). A tile is BLOCK_Q query tokens of one request times the GROUP
    query heads that share kv_head, packed into BLOCK_M rows, so each K/V tile loaded serves
    the whole group. Tiles are numbered request by request: request i owns the
    cdiv(q_i, BLOCK_Q) tiles from first_tile(i) = query_start_loc[i] // BLOCK_Q + i on (just
    query_start_loc[i] when BLOCK_Q is 1), so the grid is bounded by shapes and spare tiles
    exit. With SPLIT, the live context decides (read here, so a graph's replay sees the step's
    lengths): the tile's KV range is cut into `live` equal parts of at least two KV tiles, at
    most num_splits; split s < live writes an unnormalised partial that _combine_kernel
    reduces, the others exit at once, and with one live part split 0 writes the output itself
    (the combine then skips the row). live_ptr holds each token's live part count. MERGE: no
    combine launch; the last live part of a tile to finish merges the parts, row by row
    (_merge_parts: one compiled variant for every split count; count_ptr: a zeroed count per
    tile and KV head, set back to 0 by that part).
    DIRECT (no SPLIT): a request with no context (a fresh prompt) reads its KV from this
    step's k_ptr / v_ptr [tokens, kv_heads, head_dim], which hold what the cache holds there,
    without the block-table load each cache tile waits on, in a loop pipelined DIRECT_STAGES
    deep. A request with context reads the cache alone: its new tokens' tiles from k and v
    after the cache's tiles were up to 11% slower than all from the cache, and a branch
    around the loops stopped their pipelining (benchmarks/h100-2026-11-27-s28.md).
    ROPE (one token per request, BLOCK_Q 1): q and this step's k_ptr / v_ptr row come as the
    QKV projection left them; the kernel rotates q and k (after Qwen3's per-head norms, weights
    q_norm_ptr / k_norm_ptr, with NORM_QK) as kernels/rope_store.py does, and the one part
    whose KV range holds the token's position stores its k and v at the token's slot, then
    reads them back with the rest of its range: no other program reads that slot, so the store
    races nothing, and the step needs no RoPE + store kernel of its own.
    PDL: lengths, block table and query starts are the step's inputs, written by
    kernels/unpack.py before the step's first kernel, which waits for it: torch's embedding, or
    a later pipeline stage's receive, launched without PDL. So finding the tile's request and
    KV range overlaps the kernel before this one; q and the cache are read after the wait
    (qwen3-0.6b's batch-1 decode 0.947 -> 0.932 ms on the H100,
    benchmarks/h100-2026-11-26-s27.md)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    # request = number of requests whose first tile is <= this tile, minus one
    req = -1
    for c in range(0, num_reqs, REQ_CHUNK):
        i = c + tl.arange(0, REQ_CHUNK)
        first = tl.load(query_start_loc_ptr + i, mask=i < num_reqs, other=2**30)
        if BLOCK_Q > 1:
            first = first // BLOCK_Q + i
        req += tl.sum((first <= tile).to(tl.int32), axis=0)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    local = tile - (q_start // BLOCK_Q + req if BLOCK_Q > 1 else q_start)
    # the latest query tiles, with the most KV, are launched first so short ones fill the tail
    q_tile = tl.cdiv(q_len, BLOCK_Q) - 1 - local
    if q_tile < 0:
        return
    ctx_len = seq_len - q_len
    first_pos = ctx_len + q_tile * BLOCK_Q
    kv_hi = tl.minimum(seq_len, first_pos + BLOCK_Q)
    kv_lo = 0
    live = 1
    if SPLIT:
        live = tl.maximum(tl.minimum(num_splits, tl.cdiv(kv_hi, 2 * BLOCK_N)), 1)
        if split >= live:
            return
        part_len = tl.cdiv(tl.cdiv(kv_hi, live), BLOCK_N) * BLOCK_N
        kv_lo = split * part_len
        kv_hi = tl.minimum(kv_hi, kv_lo + part_len)

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    pos = ctx_len + q_idx
    token = (q_start + q_idx).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    if ROPE:  # what no kernel of this step writes, read before the wait
        # neox RoPE over whole rows: element d pairs with d + half (mod head_dim), so one
        # layout serves both halves: x * cos + partner * (-sin on the first half, sin after).
        # Every vector is loaded as a tile of q's shape (rows alike): no layout conversions.
        cols = d[None, :] + tl.zeros([BLOCK_M, 1], tl.int32)
        partner = (cols + HEAD_DIM // 2) % HEAD_DIM
        new_pos = seq_len - 1  # the request's one token
        cos_row = cos_sin_ptr + tl.maximum(new_pos, 0).to(tl.int64) * stride_cos
        cos = tl.load(cos_row + cols % (HEAD_DIM // 2))
        sin = tl.load(cos_row + HEAD_DIM // 2 + cols % (HEAD_DIM // 2))
        sin = tl.where(cols < HEAD_DIM // 2, -sin, sin)
        slot = tl.load(slot_ptr + q_start).to(tl.int64)
        qw, qw_partner, kw, kw_partner = 0.0, 0.0, 0.0, 0.0
        if NORM_QK:
            qw = tl.load(q_norm_ptr + cols).to(tl.float32)
            qw_partner = tl.load(q_norm_ptr + partner).to(tl.float32)
            kw = tl.load(k_norm_ptr + cols).to(tl.float32)
            kw_partner = tl.load(k_norm_ptr + partner).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()  # q and the KV cache: the kernels before this one write them
    q_rows = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    if ROPE:
        q = _rotated(q_rows, row_ok[:, None], cols, partner, qw, qw_partner, cos, sin, eps,
                     HEAD_DIM, NORM_QK)  # fmt: skip
        # the token's k row in every row of a tile like q's: one layout for both rotations
        new_row = q_start.to(tl.int64) * stride_kt + kv_head * stride_kh
        k_rows = k_ptr + new_row + tl.zeros([BLOCK_M, 1], tl.int64)
        k_new = _rotated(k_rows, rows[:, None] >= 0, cols, partner, kw, kw_partner, cos, sin,
                         eps, HEAD_DIM, NORM_QK)  # fmt: skip
        if (kv_lo <= new_pos) & (new_pos < kv_hi) & (slot >= 0):  # the part that reads it
            first = rows[:, None] == 0
            dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + kv_head * stride_ch
            tl.store(k_cache_ptr + dst + cols, k_new, mask=first)
            v_new = tl.load(v_ptr + new_row + cols, mask=first)
            tl.store(v_cache_ptr + dst + cols, v_new, mask=first)
            tl.debug_barrier()  # stored before any thread of the program loads that tile
    else:
        q = tl.load(q_rows + d[None, :], mask=row_ok[:, None], other=0.0)
    unmasked_hi = (
        kv_lo + tl.maximum(tl.minimum(kv_hi, first_pos + 1) - kv_lo, 0) // BLOCK_N * BLOCK_N
    )

    m_i = tl.full([BLOCK_M], -1e30, tl.float32)  # finite: fully masked rows stay NaN-free
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    # a fresh prompt's KV tiles (no context: every position is this step's) come from rows
    # q_start on of k and v; a request with context reads the cache alone. Loop bounds, not a
    # branch, pick the source: loops under a runtime branch ran up to 1.8x slower.
    # (a warm-up batch clamps seq_len below q_len: its first tiles' kv_hi lies below 0, and
    # this bound keeps their k/v loops empty)
    new_lo = tl.maximum(kv_hi, unmasked_hi)
    if DIRECT:
        new_lo = tl.where(ctx_len == 0, 0, new_lo)
        new_rows = q_start.to(tl.int64) * stride_kt + kv_head * stride_kh
        k_new, v_new = k_ptr + new_rows, v_ptr + new_rows
    for start in range(kv_lo, tl.minimum(unmasked_hi, new_lo), BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_base, v_base, bt_row, start, kv_hi, pos, qk_scale,
            stride_cb, stride_cs, BLOCK_N, HEAD_DIM, PAGE, False, PRECISION, False,
        )  # fmt: skip
    if DIRECT:
        for start in tl.range(new_lo, unmasked_hi, BLOCK_N, num_stages=DIRECT_STAGES):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, k_new, v_new, bt_row, start, kv_hi, pos, qk_scale, stride_cb,
                stride_kt, BLOCK_N, HEAD_DIM, PAGE, False, PRECISION, True,
            )  # fmt: skip
    for start in range(unmasked_hi, tl.maximum(new_lo, unmasked_hi), BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_base, v_base, bt_row, start, kv_hi, pos, qk_scale,
            stride_cb, stride_cs, BLOCK_N, HEAD_DIM, PAGE, True, PRECISION, False,
        )  # fmt: skip
    if DIRECT:
        for start in range(tl.maximum(new_lo, unmasked_hi), kv_hi, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, k_new, v_new, bt_row, start, kv_hi, pos, qk_scale, stride_cb,
                stride_kt, BLOCK_N, HEAD_DIM, PAGE, True, PRECISION, True,
            )  # fmt: skip

    if SPLIT and not MERGE:  # split 0 of every token's row, for the combine
        first = (rows * 0 + split) == 0
        tl.store(live_ptr + token, tl.zeros_like(rows) + live, mask=row_ok & first)
    if live > 1:
        part = (token * (GROUP * tl.num_programs(1)) + head) * num_splits + split
        tl.store(part_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(l_ptr + part, l_i, mask=row_ok)
        if MERGE:
            count = count_ptr + tile * tl.num_programs(1) + kv_head
            tl.debug_barrier()  # every thread's partial stored before the count releases them
            if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == live - 1:
                tl.store(count, 0)
                for r in range(BLOCK_Q * GROUP):  # this tile's rows
                    t = q_tile * BLOCK_Q + r // GROUP
                    if t < q_len:
                        row_token = (q_start + t).to(tl.int64)
                        row_head = kv_head * GROUP + r % GROUP
                        _merge_parts(
                            out_ptr + row_token * stride_ot + row_head * stride_oh, part_ptr,
                            m_ptr, l_ptr, row_token * (GROUP * tl.num_programs(1)) + row_head,
                            live, num_splits, HEAD_DIM,
                        )  # fmt: skip
    else:
        o = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
        o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, o, mask=row_ok[:, None])


@jit(do_not_specialize=["num_reqs"])
def _combine_kernel(
    out_ptr, part_ptr, m_ptr, l_ptr, live_ptr, query_start_loc_ptr, num_reqs, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (token, head): merges the live partials of one row by their softmax weights; a row
    with one live part was written by the attention kernel and is skipped.
    Measured on the H100, this second launch beats merging in the attention kernel's last
    part to finish (MERGE) at every batch and context tried, inside a CUDA graph; MERGE
    saves a launch's host time where there is none (eager steps)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_reqs):
        return  # a padding token of no request: nothing was computed, nothing is written
    live = tl.load(live_ptr + token)
    if live <= 1:
        return
    row = token.to(tl.int64) * tl.num_programs(1) + head
    _merge_row(
        out_ptr + token * stride_ot + head * stride_oh, part_ptr, m_ptr, l_ptr, row, live,
        HEAD_DIM, SPLITS,
    )  # fmt: skip


@jit
def _merge_row(out_row, part_ptr, m_ptr, l_ptr, row, live, HEAD_DIM: tl.constexpr,
               SPLITS: tl.constexpr):  # fmt: skip
    """out_row = the live partials of row (token * heads + head) merged by their softmax
    weights. .cg loads: from L2, where other programs wrote."""
    base = row * SPLITS
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, HEAD_DIM)
    m = tl.load(m_ptr + base + s, mask=s < live, other=float("-inf"), cache_modifier=".cg")
    w = tl.exp2(m - tl.max(m, axis=0))
    l_part = tl.load(l_ptr + base + s, mask=s < live, other=0.0, cache_modifier=".cg")
    l_sum = tl.sum(l_part * w, axis=0)
    acc = tl.load(
        part_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=(s < live)[:, None],
        other=0.0, cache_modifier=".cg",
    )  # fmt: skip
    o = tl.sum(acc * w[:, None], axis=0) / l_sum
    tl.store(out_row + d, o.to(out_row.dtype.element_ty))


_MERGE_CHUNK = tl.constexpr(8)  # parts _merge_parts reads at once


@jit
def _merge_parts(out_row, part_ptr, m_ptr, l_ptr, row, live, num_splits,
                 HEAD_DIM: tl.constexpr):  # fmt: skip
    """_merge_row for any split count: the live parts _MERGE_CHUNK at a time, rescaled to the
    running maximum (as attention's own softmax), so one compiled kernel serves every count.
    The same math as _merge_row (the first chunk's rescale is by 0); its sums run over 8 lanes
    and, past 8 parts, in rounds, so the last bits may differ."""
    base = row * num_splits
    d = tl.arange(0, HEAD_DIM)
    m_run = float("-inf")
    l_run = 0.0
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for first in range(0, live, _MERGE_CHUNK):
        s = first + tl.arange(0, _MERGE_CHUNK)
        ok = s < live
        m = tl.load(m_ptr + base + s, mask=ok, other=float("-inf"), cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        rescale = tl.exp2(m_run - m_new)
        w = tl.exp2(m - m_new)
        l_part = tl.load(l_ptr + base + s, mask=ok, other=0.0, cache_modifier=".cg")
        parts = tl.load(
            part_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0,
            cache_modifier=".cg",
        )  # fmt: skip
        l_run = l_run * rescale + tl.sum(l_part * w, axis=0)
        acc = acc * rescale + tl.sum(parts * w[:, None], axis=0)
        m_run = m_new
    tl.store(out_row + d, (acc / l_run).to(out_row.dtype.element_ty))


_SHORT_QUERY = 8  # mean query length up to which a batch is decode-like
_LOG2E = 1.4426950408889634


class Rope(NamedTuple):
    """What a decode launch needs to rotate q and k and store k and v itself (ROPE): the
    model's cos|sin table (float32 [max_position, head_dim]), the step's slot_mapping, and
    whether q and k take Qwen3's per-head norms first (their eps; the weights come per layer,
    as each layer's q)."""

    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor
    norm: bool
    eps: float


class Config(NamedTuple):
    block_q: int  # query tokens per tile; block_q * group rows, padded to block_m
    block_m: int
    block_n: int  # KV positions per step
    splits: int  # KV partitions per tile, reduced by _combine_kernel when > 1
    num_warps: int
    num_stages: int


def choose_config(q, k_cache, block_table, num_reqs: int) -> Config:
    """A launch configuration from shapes alone (never from lengths), so it is fixed under a
    CUDA graph. Batches of short queries (decode, speculative decode) get few rows per tile and
    split the KV so a handful of requests still fills the GPU; others get large tiles.
    num_reqs is the padded count under a graph: FULL prefill graphs pad to 1 or 4 requests
    (graphs/plan.py), few enough that a long prompt keeps the large tiles.

    num_stages 5: the page-table load feeding each K/V address takes a pipeline stage of its
    own, and fewer stages leave no K/V tile in flight while the previous one is computed."""
    num_tokens, num_heads, _ = q.shape
    shape = LayerShape.of(num_heads, k_cache)
    return _config(shape, num_tokens, num_reqs, block_table.shape[1], attention_sms(q.device))


def attention_sms(device: torch.device) -> int:
    """The SM count launch configurations are sized by; 8 under the interpreter, so CPU tests
    reach split launches."""
    return num_sms(device, 8)


class LayerShape(NamedTuple):
    """What a layer's attention launches depend on besides the batch."""

    num_heads: int
    head_dim: int
    itemsize: int  # of q and the cache
    page: int  # block size of the KV cache
    kv_heads: int

    @classmethod
    def of(cls, num_heads: int, k_cache: torch.Tensor) -> LayerShape:
        """num_heads query heads over one layer's cache [blocks, page, kv_heads, head_dim]."""
        page, kv_heads, head_dim = k_cache.shape[1:]
        return cls(num_heads, head_dim, k_cache.element_size(), page, kv_heads)


def _config(shape: LayerShape, num_tokens: int, num_reqs: int, width: int, sms: int) -> Config:
    """choose_config's rule; width: the block table's blocks per request."""
    num_heads, head_dim, itemsize, page, kv_heads = shape
    group = num_heads // kv_heads
    wide = max(head_dim, 128) * itemsize  # bytes of one K row, at least 256
    if num_tokens <= _SHORT_QUERY * num_reqs:
        block_q = min(triton.next_power_of_2(triton.cdiv(num_tokens, num_reqs)), _SHORT_QUERY)
        block_n = max(16, 8192 // wide)  # 8 KiB K tiles: ~5 programs per SM hide latency
        programs = _num_tiles(num_tokens, num_reqs, block_q) * kv_heads
        # at the longest context the block table holds, each part still spans 4 KV tiles
        most = width * page // (4 * block_n)
        splits = _splits(programs, sms, most)
        block_m = max(16, triton.next_power_of_2(block_q * group))
        return Config(block_q, block_m, block_n, splits, num_warps=4, num_stages=5)
    if itemsize > 2:  # float32 dots run on FMA units: sized to fit, not tuned
        block_m, block_n, num_warps, num_stages = 64, 16, 4, 3
    elif wide == 256:  # head_dim <= 128: fastest of the H100 sweep for 8 x 512 and 1 x 4096
        block_m, block_n, num_warps, num_stages = 64, 64, 4, 2
    else:
        block_m, block_n, num_warps, num_stages = 128 * 256 // wide, 16384 // wide, 8, 5
    block_q = max(1, block_m // group)
    block_m = max(block_m, triton.next_power_of_2(group))
    return Config(block_q, block_m, block_n, 1, num_warps, num_stages)


def launch_classes(
    shape: LayerShape, width: int, sms: int, max_reqs: int, max_tokens: int
) -> list[tuple[int, int]]:
    """One batch (num_tokens, num_reqs) for each compiled attention kernel that steps of up to
    max_reqs requests and max_tokens tokens can launch: every tile height of short queries,
    with a split KV and without where the sizes reach them, and the long-query launch.
    Splits of any count >= 2 share one kernel (merged in it or combined after), so a warm-up
    that runs these batches eagerly compiles all an eager step can need."""
    classes: dict[Config, tuple[int, int]] = {}
    counts = {min(1 << i, max_reqs) for i in range(max_reqs.bit_length() + 1)}
    for per in (1, 2, 4, _SHORT_QUERY, 2 * _SHORT_QUERY):
        fullest = max(1, min(max_reqs, max_tokens // per))  # the most programs at this length
        for reqs in sorted(counts | {fullest}):
            if reqs * per <= max_tokens:
                config = _config(shape, reqs * per, reqs, width, sms)
                kernel = config._replace(splits=min(config.splits, 2))
                classes.setdefault(kernel, (reqs * per, reqs))
    return list(classes.values())


# Pipeline depth of a fresh prompt's loop over KV tiles read from k and v. On the H100
# (Llama-3.1-8B and qwen3-0.6b heads, benchmarks/h100-2026-11-27-s28.md) 3 stages beat 2 by
# 1.04-1.12x at 1,024-4,096 tokens and 4 lost at all but the shortest (up to 1.5x), while the
# cache's loop, whose block-table loads take a stage of their own, is fastest at the launch's 2.
DIRECT_STAGES = 3

# Programs per SM a split KV aims for. The H100 decode sweep (bench_kernels decode-sweep,
# Llama-3.1-8B heads, contexts 576 and 1088) was fastest at about 2: 32 parts for one request,
# 4 for 8, none for 32 (34.1 µs against 40.1 with 2 parts at 576); 4 per SM split 32 requests.
PROGRAMS_PER_SM = 2


def _splits(programs: int, num_sms: int, most: int) -> int:
    """A power of two (few compiled variants), at most `most`, bringing the programs to about
    PROGRAMS_PER_SM per SM (not above it: a second wave of parts costs more than it hides)."""
    want = min(max(PROGRAMS_PER_SM * num_sms // programs, 1), max(most, 1))
    return 1 << (want.bit_length() - 1)


def _num_tiles(num_tokens: int, num_reqs: int, block_q: int) -> int:
    return num_tokens if block_q == 1 else num_tokens // block_q + num_reqs


class PagedAttention:
    """Paged attention over one batch: launch configuration, grids, split-KV scratch and the
    compiled kernels, fixed once from the first layer's q and out and launched for every layer
    with that layer's tensors (same shapes, strides and cache geometry).

    Sizes come from shapes (num_reqs is the padded request count) and lengths are read on the
    device, so an instance built inside a CUDA graph capture is right for every replay."""

    def __init__(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        scale: float,
        config: Config | None = None,
        merge: bool = False,
        new_kv: torch.Tensor | None = None,
        rope: Rope | None = None,
    ) -> None:
        """merge: the attention kernel merges a split KV's parts itself (MERGE), no combine
        launch: for eager steps, which pay a launch's host time; a graph's replay does not.
        new_kv: a tensor of this step's k or v [num_tokens, kv_heads, head_dim] (both have its
        strides), already in the cache: a long-query launch then reads fresh prompts' KV from
        k and v rather than through the block table (DIRECT); each call passes them.
        rope: a batch of one token per request whose q and new_kv are not yet rotated nor
        stored: the kernel does both (ROPE); each call passes k, v and the layer's norm
        weights."""
        num_tokens, num_heads, head_dim = q.shape
        num_reqs = seq_lens.shape[0]
        self.attend = self.combine = None
        self.direct = False
        if num_tokens == 0 or num_reqs == 0:
            return
        cfg = config or choose_config(q, k_cache, block_table, num_reqs)
        # fresh prompts come in long-query launches, which never split the KV
        long = num_tokens > _SHORT_QUERY * num_reqs
        self.direct = new_kv is not None and long and cfg.splits == 1
        self.rope = rope is not None
        assert not self.rope or (cfg.block_q == 1 and new_kv is not None)
        reads_kv = self.direct or self.rope
        kv_strides = (new_kv.stride(0), new_kv.stride(1)) if reads_kv else (0, 0)
        # a launch without ROPE takes any pointer for the table and slots it never reads
        cos_sin, slots = (rope.cos_sin_cache, rope.slot_mapping) if rope else (seq_lens, seq_lens)
        kv_heads, page = k_cache.shape[2], k_cache.shape[1]
        group = num_heads // kv_heads
        assert k_cache.stride(3) == 1 and q.stride(2) == out.stride(2) == block_table.stride(1) == 1
        assert head_dim & (head_dim - 1) == 0 and num_heads == group * kv_heads
        assert cfg.block_m >= cfg.block_q * group and cfg.splits & (cfg.splits - 1) == 0
        split = cfg.splits > 1
        merge = merge and split
        tiles = _num_tiles(num_tokens, num_reqs, cfg.block_q)
        # partial outputs and their softmax max / sum, only when the KV is split
        part_shape = (num_tokens, num_heads, cfg.splits) if split else (1,)
        part = torch.empty((*part_shape, head_dim), dtype=torch.float32, device=q.device)
        stats = torch.empty((2, *part_shape), dtype=torch.float32, device=q.device)
        live = torch.empty(num_tokens if split else 1, dtype=torch.int32, device=q.device)
        # zeroed only to merge (eager instances): a capture would record the zeroing
        counts = (
            torch.zeros(tiles * kv_heads, dtype=torch.int32, device=q.device) if merge else live
        )
        pdl = pdl_options()
        self.attend = Launch(
            _attention_kernel,
            (tiles, kv_heads, cfg.splits),
            num_head=8,  # q, k_cache, v_cache, out, k, v, q and k norm weights: each layer's own
            tail=(
                part,
                stats[0],
                stats[1],
                live,
                counts,
                query_start_loc,
                seq_lens,
                block_table,
                cos_sin,
                slots,
                scale * _LOG2E,
                rope.eps if rope else 0.0,
                num_reqs,
                q.stride(0),
                q.stride(1),
                out.stride(0),
                out.stride(1),
                k_cache.stride(0),
                k_cache.stride(1),
                k_cache.stride(2),
                block_table.stride(0),
                *kv_strides,
                cos_sin.stride(0),
            ),  # fmt: skip
            constexprs=dict(
                GROUP=group,
                BLOCK_Q=cfg.block_q,
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                HEAD_DIM=head_dim,
                PAGE=page,
                SPLIT=split,
                MERGE=merge,
                REQ_CHUNK=128,
                PRECISION=_precision(q.dtype),
                DIRECT=self.direct,
                DIRECT_STAGES=DIRECT_STAGES,
                ROPE=self.rope,
                NORM_QK=bool(rope and rope.norm),
                PDL=pdl["PDL"],
            ),  # fmt: skip
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            launch_pdl=pdl["launch_pdl"],
        )
        if split and not merge:
            self.combine = Launch(
                _combine_kernel,
                (num_tokens, num_heads, 1),
                num_head=1,  # out
                tail=(
                    part,
                    stats[0],
                    stats[1],
                    live,
                    query_start_loc,
                    num_reqs,
                    out.stride(0),
                    out.stride(1),
                ),  # fmt: skip
                constexprs=dict(HEAD_DIM=head_dim, SPLITS=cfg.splits, PDL=pdl["PDL"]),
                launch_pdl=pdl["launch_pdl"],
            )

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
    ) -> None:
        """k, v: this step's, with new_kv's strides; read only by a DIRECT or ROPE launch.
        q_norm, k_norm: the layer's per-head norm weights, read only by a ROPE launch with
        norms."""
        if self.attend is None:
            return
        self.attend(*self._head(q, k_cache, v_cache, out, k, v, q_norm, k_norm))
        if self.combine is not None:
            self.combine(out)

    def bind(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
        k: torch.Tensor | None = None, v: torch.Tensor | None = None,
    ) -> Callable[[], None] | None:  # fmt: skip
        """This instance's call with these tensors (no norms), for a caller that passes the
        same ones every time and keeps this instance alive meanwhile (Launch.bind). None until
        each launch has run once with them."""
        if self.attend is None:
            return _nothing
        attend = self.attend.bind(*self._head(q, k_cache, v_cache, out, k, v, None, None))
        if self.combine is None or attend is None:
            return attend
        combine = self.combine.bind(out)
        return combine and (lambda: (attend(), combine()))

    def _head(self, q, k_cache, v_cache, out, k, v, q_norm, k_norm) -> tuple[torch.Tensor, ...]:
        """The attention launch's per-layer arguments; a pointer it never reads takes q's."""
        if self.direct or self.rope:
            return (q, k_cache, v_cache, out, k, v, q_norm if q_norm is not None else q,
                    k_norm if k_norm is not None else q)  # fmt: skip
        return (q, k_cache, v_cache, out, k_cache, v_cache, q, q)


def _nothing() -> None:
    """An instance with nothing to attend (no tokens or no requests) launches nothing."""


def _precision(dtype: torch.dtype) -> str:
    """tf32 would cost float32 models their accuracy; half types ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"
