"""Batched LoRA for a step in which each token has its own adapter or none.

Adapters live in fixed slots: per projection, `a` [slots, shards * R, K] and `b` [slots, N, R],
where R is max_lora_rank and shard s (q, k, v of a merged projection) owns rows
[s * R, s * R + rank) of `a` and output columns [offsets[s], offsets[s + 1]) of `b`; the
scaling is folded into `b`, and `ranks` [slots, shards] gives each slot's rank per shard (0: the
adapter leaves that projection alone). Tokens are grouped by adapter (`LoRAMetadata`):
group i holds the `counts[i]` tokens listed from `token_indices[starts[i]]` on, all using slot
`slots[i]`, so each program reads one adapter's weights once for a block of its tokens.

shrink: partials[p, t] = x[t] @ a[slot]^T over the p-th split of K (float32)
expand: y[t, shard] += (sum_p partials[p, t, shard]) @ b[slot, shard]^T, in place
expand_silu (a merged gate|up): silu(y_gate + its term) * (y_up + its term), a new tensor

With a norm before the projection (its norm in the projection kernel's prologue, lora/layer.py
at one row), the shrink takes rms_norm(x)'s input instead: rms_norm(s) = s * weight / rms(s),
one scale a token, so it sums (s * weight) @ a^T and keeps mean(s^2) in a last column, and the
expands multiply by 1/rms(s).

Graph-safe: the grid depends on the padded token count and the padded number of groups (both
fixed by the batch descriptor), every count and index is read on the device, and spare
programs exit. Tokens of no group (no adapter, padding) are neither read nor written.

The kernels take programmatic dependent launch (Hopper): what was written before the step
(the groups, the slots' weights) is read while the kernel before still runs; what that kernel
writes (x, y, partials) only after gdc_wait. At batch 1 the chain of dependent reads (group,
slot, rank, token) was most of each kernel's time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.context import LoRAMetadata
from ostinato.kernels.activation import silu_and_mul_torch
from ostinato.kernels.dispatch import (
    SPLIT_COUNTS,
    interpreting,
    jit,
    num_sms,
    pdl_options,
    split_counts,
    use_triton,
)
from ostinato.kernels.launch import Launch
from ostinato.kernels.small_batch import arrive, gather, input_chunk

# the shrink's last split sums the partials, so expand reads one [T, shards * R] (an A/B switch
# for benches: else every expand program reads all SPLIT partials of its tokens)
SUM_SPLITS = True


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    ranks: torch.Tensor,
    meta: LoRAMetadata,
    norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
):
    """x [T, K], a [slots, shards * R, K] -> float32 partial sums [splits, T, shards * R] (one
    split, the whole sum, with SUM_SPLITS); rows of tokens outside every group are left
    unwritten. norm (residual or None, norm weight, eps), for a projection that takes its
    norm in its prologue: of rms_norm(x + residual) up to its one scale a token, 1/rms, which
    the expand applies (norm_eps): the sums are of s * weight, s = x + residual rounded as the
    fused add + norm kernel stores it, and a last column holds the mean of s^2 (each split its
    part), from the same pass over s, so the shrink reads its input once."""
    if use_triton(x):
        return _shrink_triton(x, a, ranks, meta, norm)
    return lora_shrink_torch(x, a, ranks, meta, norm)


def lora_expand(
    partials: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor,
    offsets: tuple[int, ...],
    y: torch.Tensor,
    meta: LoRAMetadata,
    norm_eps: float | None = None,
) -> None:
    """y [T, N] += the adapter term of every grouped token; partials from lora_shrink, b
    [slots, N, R]; shard s owns columns offsets[s]:offsets[s + 1] (at most 3 shards).
    norm_eps: the shrink's norm's eps; each token's sums then times its 1/rms."""
    if use_triton(y):
        _expand_triton(partials, b, ranks, offsets, y, meta, norm_eps)
    else:
        lora_expand_torch(partials, b, ranks, offsets, y, meta, norm_eps)


def lora_expand_silu(
    partials: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor,
    offsets: tuple[int, int, int],
    y: torch.Tensor,
    meta: LoRAMetadata,
    norm_eps: float | None = None,
) -> torch.Tensor:
    """A merged gate|up's output y [T, 2I] (gate, then up; y is only read) plus the adapter
    term (norm_eps as lora_expand's), then SiLU-and-mul -> a new [T, I], each sum rounded to
    y's dtype first, as lora_expand and the SiLU kernel would store them. For steps whose every
    token has an adapter (one row): the rows of tokens outside every group are left
    unwritten."""
    assert len(offsets) == 3 and offsets[1] * 2 == offsets[2] == y.shape[1]
    if use_triton(y):
        return _expand_silu_triton(partials, b, ranks, offsets, y, meta, norm_eps)
    out = y.clone()
    lora_expand_torch(partials, b, ranks, offsets, out, meta, norm_eps)
    return silu_and_mul_torch(out)


def _groups(meta: LoRAMetadata):
    """(slot, token indices) of each non-empty group, on the host: for the torch versions."""
    counts, starts, slots = meta.counts.tolist(), meta.starts.tolist(), meta.slots.tolist()
    for count, start, slot in zip(counts, starts, slots, strict=True):
        if count:
            yield slot, meta.token_indices[start : start + count].long()


def lora_shrink_torch(x, a, ranks, meta, norm=None):
    width = a.shape[1] + (norm is not None)
    partials = torch.zeros(1, x.shape[0], width, dtype=torch.float32, device=x.device)
    if norm is not None:
        residual, weight, _ = norm
        s = (x if residual is None else x + residual).float()
        partials[0, :, -1] = s.pow(2).mean(-1)
        x = (s * weight.float()).to(x.dtype)  # rounded as the kernel takes it to the dot
    for slot, tokens in _groups(meta):
        partials[0, tokens, : a.shape[1]] = x[tokens].float() @ a[slot].float().T
    return partials


def lora_expand_torch(partials, b, ranks, offsets, y, meta, norm_eps=None):
    rank_max = b.shape[2]
    summed = partials.sum(dim=0)
    if norm_eps is not None:
        summed = summed * torch.rsqrt(summed[:, -1:] + norm_eps)
    for slot, tokens in _groups(meta):
        for s, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
            part = summed[tokens, s * rank_max : (s + 1) * rank_max].to(b.dtype).float()
            y[tokens, lo:hi] = (y[tokens, lo:hi].float() + part @ b[slot, lo:hi].float().T).to(
                y.dtype
            )


# ---- Triton ---------------------------------------------------------------------------------


@jit
def _group(group, counts_ptr, slots_ptr, starts_ptr):
    """(count, slot, start) of a group: its tokens are listed at token_indices[start:]."""
    count = tl.load(counts_ptr + group)
    return count, tl.load(slots_ptr + group).to(tl.int64), tl.load(starts_ptr + group)


@jit
def _tile_tokens(tile, count, start, tokens_ptr, BLOCK_M: tl.constexpr):
    """The token indices (int64) of a group's tile of BLOCK_M rows, and which rows it has."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < count
    return tl.load(tokens_ptr + start + rows, mask=row_ok, other=0).to(tl.int64), row_ok


@jit(do_not_specialize=["num_shards"])  # one compiled variant for every projection
def _shrink_kernel(
    x_ptr, a_ptr, ranks_ptr, out_ptr, tokens_ptr, slots_ptr, starts_ptr, counts_ptr, sem_ptr,
    res_ptr, norm_ptr, K, num_shards, stride_x, stride_a, stride_split, stride_out, stride_r,
    R: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, SUM: tl.constexpr, NORM: tl.constexpr,
    ADD_IN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (token tile * SPLIT, shard, group): one split of K for BLOCK_M tokens of a group.
    SUM: the last split of each (tile, shard, group) to finish sums the SPLIT partials in split
    order into split 0's place (kernels/small_batch.py's count at sem_ptr). NORM: of each
    token's s * weight (weight at norm_ptr; s = x, plus res_ptr's row with ADD_IN), and shard
    0's programs store their split's part of mean(s^2) in column num_shards * R (which the
    last of them sums with SUM; shard 0 runs at rank 0 too, for it)."""
    tile = tl.program_id(0) // SPLIT
    split = tl.program_id(0) % SPLIT
    shard = tl.program_id(1)
    group = tl.program_id(2)
    count, slot, start = _group(group, counts_ptr, slots_ptr, starts_ptr)
    if tile * BLOCK_M >= count:
        return
    rank = tl.load(ranks_ptr + slot * num_shards + shard)
    if rank == 0 and (not NORM or shard != 0):
        return
    token, row_ok = _tile_tokens(tile, count, start, tokens_ptr, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    a_rows = a_ptr + slot * stride_a + (shard * R + r)[None, :] * K
    span = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
    k_lo = split * span
    k = k_lo + tl.arange(0, BLOCK_K)
    at = tl.load(a_rows + k[:, None], mask=(r < rank)[None, :] & (k < K)[:, None], other=0.0)
    if PDL:  # the first tile of A came in while the kernel before ran; x is its output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x_rows = x_ptr + token[:, None] * stride_x
    r_rows = res_ptr + token[:, None] * stride_r
    squares = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + span, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        if k0 != k_lo:
            at = tl.load(a_rows + k[:, None], mask=(r < rank)[None, :] & k_ok[:, None], other=0.0)
        ok = row_ok[:, None] & k_ok[None, :]
        xt = input_chunk(x_rows + k[None, :], r_rows + k[None, :], ok, ADD_IN)
        if NORM:
            xf = xt.to(tl.float32)
            squares += tl.sum(xf * xf, axis=1)
            g = tl.load(norm_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            xt = (xf * g[None, :]).to(xt.dtype)
        acc += tl.dot(xt, at, input_precision=PRECISION)
    out = out_ptr + token[:, None] * stride_out + (shard * R + r)[None, :]
    ok = row_ok[:, None] & (r < R)[None, :]
    tl.store(out + split * stride_split, acc, mask=ok)
    mean_sq = out_ptr + token * stride_out + num_shards * R
    if NORM:
        sq_ok = tl.where(shard == 0, row_ok, False)
        tl.store(mean_sq + split * stride_split, squares / K, mask=sq_ok)
    if SUM:
        tiles = tl.num_programs(0) // SPLIT
        sem = sem_ptr + (group * tl.num_programs(1) + shard) * tiles + tile
        last = arrive(sem, SPLIT)
        ok = tl.where(last, ok, False)  # (the interpreter's ok & last would be integers)
        tl.store(out, gather(out, stride_split, ok, SPLIT), mask=ok)
        if NORM:
            sq_ok = tl.where(last, sq_ok, False)
            tl.store(mean_sq, gather(mean_sq, stride_split, sq_ok, SPLIT), mask=sq_ok)
        tl.store(sem, 0, mask=last)


@jit(do_not_specialize=["num_shards"])
def _expand_kernel(
    p_ptr, b_ptr, ranks_ptr, y_ptr, tokens_ptr, slots_ptr, starts_ptr, counts_ptr,
    end_0, end_1, end_2, n_tiles, num_shards, stride_split, stride_p, stride_b, stride_y, eps,
    R: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, NORM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Grid (token tile * n_tiles, shard, group): BLOCK_N output columns of one shard for
    BLOCK_M tokens of a group; the SPLIT partials are summed here. Shard s ends at column
    end_s and starts where the one before it ends. NORM: each token's sums times its 1/rms
    (_inv_rms)."""
    tile_m = tl.program_id(0) // n_tiles
    tile_n = tl.program_id(0) % n_tiles
    shard = tl.program_id(1)
    group = tl.program_id(2)
    count, slot, start = _group(group, counts_ptr, slots_ptr, starts_ptr)
    if tile_m * BLOCK_M >= count:
        return
    n_hi = tl.where(shard == 0, end_0, tl.where(shard == 1, end_1, end_2))
    n_lo = tl.where(shard == 0, 0, tl.where(shard == 1, end_0, end_1)) + tile_n * BLOCK_N
    if n_lo >= n_hi:
        return
    rank = tl.load(ranks_ptr + slot * num_shards + shard)
    if rank == 0:
        return
    token, row_ok = _tile_tokens(tile_m, count, start, tokens_ptr, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    n = n_lo + tl.arange(0, BLOCK_N)
    n_ok = n < n_hi
    bt = tl.load(
        b_ptr + slot * stride_b + n[None, :] * R + r[:, None],
        mask=r_ok[:, None] & n_ok[None, :],
        other=0.0,
    )
    if PDL:  # B came in while the kernel before ran; the partials and y are written in-step
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    sp = tl.arange(0, SPLIT)
    p = p_ptr + sp[:, None, None] * stride_split + token[None, :, None] * stride_p
    p = tl.load(
        p + (shard * R + r)[None, None, :],
        mask=row_ok[None, :, None] & r_ok[None, None, :],
        other=0.0,
    )
    part = tl.sum(p, axis=0)
    if NORM:
        part *= _inv_rms(p_ptr, sp, token, row_ok, num_shards * R, stride_split, stride_p, eps)
    y = y_ptr + token[:, None] * stride_y + n[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    out = tl.load(y, mask=mask, other=0.0).to(tl.float32)
    out += tl.dot(part.to(bt.dtype), bt, input_precision=PRECISION)
    tl.store(y, out.to(y_ptr.dtype.element_ty), mask=mask)


@jit
def _inv_rms(p_ptr, sp, token, row_ok, column, stride_split, stride_p, eps):
    """[BLOCK_M, 1]: 1/rms of each token's normed input, from the mean squares the shrink
    left in `column` of its partials (summed over the splits here)."""
    mean_sq = tl.load(p_ptr + sp[:, None] * stride_split + token[None, :] * stride_p + column,
                      mask=row_ok[None, :], other=0.0)  # fmt: skip
    return tl.rsqrt(tl.sum(mean_sq, axis=0) + eps)[:, None]


@jit(do_not_specialize=["num_shards"])
def _expand_silu_kernel(
    p_ptr, b_ptr, ranks_ptr, y_ptr, act_ptr, tokens_ptr, slots_ptr, starts_ptr, counts_ptr,
    half, n_tiles, num_shards, stride_split, stride_p, stride_b, stride_y, stride_act, eps,
    R: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (token tile * n_tiles, 1, group): BLOCK_N columns of act for BLOCK_M tokens of a
    group, from gate column n and up column half + n of y, each plus its shard's adapter term
    (none where the adapter leaves that shard alone: every program stores its act). NORM as
    _expand_kernel's."""
    tile_m = tl.program_id(0) // n_tiles
    n = (tl.program_id(0) % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(2)
    count, slot, start = _group(group, counts_ptr, slots_ptr, starts_ptr)
    if tile_m * BLOCK_M >= count:
        return
    token, row_ok = _tile_tokens(tile_m, count, start, tokens_ptr, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    n_ok = n < half
    gate_ok = r < tl.load(ranks_ptr + slot * num_shards)
    up_ok = r < tl.load(ranks_ptr + slot * num_shards + 1)
    b_cols = b_ptr + slot * stride_b + n[None, :] * R + r[:, None]
    b_gate = tl.load(b_cols, mask=gate_ok[:, None] & n_ok[None, :], other=0.0)
    b_up = tl.load(b_cols + half * R, mask=up_ok[:, None] & n_ok[None, :], other=0.0)
    if PDL:  # B came in while the kernel before ran; the partials and y are written in-step
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    sp = tl.arange(0, SPLIT)
    p = p_ptr + sp[:, None, None] * stride_split + token[None, :, None] * stride_p
    p_gate = tl.load(p + r[None, None, :], mask=row_ok[None, :, None] & gate_ok[None, None, :],
                     other=0.0)  # fmt: skip
    p_up = tl.load(p + (R + r)[None, None, :], mask=row_ok[None, :, None] & up_ok[None, None, :],
                   other=0.0)  # fmt: skip
    part_gate, part_up = tl.sum(p_gate, axis=0), tl.sum(p_up, axis=0)
    if NORM:
        inv_rms = _inv_rms(p_ptr, sp, token, row_ok, num_shards * R, stride_split, stride_p, eps)
        part_gate, part_up = part_gate * inv_rms, part_up * inv_rms
    y = y_ptr + token[:, None] * stride_y + n[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    dtype = y_ptr.dtype.element_ty
    gate = tl.load(y, mask=mask, other=0.0).to(tl.float32)
    gate += tl.dot(part_gate.to(b_gate.dtype), b_gate, input_precision=PRECISION)
    up = tl.load(y + half, mask=mask, other=0.0).to(tl.float32)
    up += tl.dot(part_up.to(b_up.dtype), b_up, input_precision=PRECISION)
    gate = gate.to(dtype).to(tl.float32)  # each rounded as lora_expand stores it
    act = gate * tl.sigmoid(gate) * up.to(dtype).to(tl.float32)
    tl.store(act_ptr + token[:, None] * stride_act + n[None, :], act.to(dtype), mask=mask)


def _block_m(num_tokens: int, block_r: int) -> int:
    """Tokens per program: as few as the batch needs, and a [block_m, block_r] float32 tile
    of at most 4096 elements."""
    by_tokens = 16 if num_tokens <= 16 else 32 if num_tokens <= 64 else 64
    return min(by_tokens, max(16, 4096 // block_r))


def _block_r(rank_max: int) -> int:
    return max(16, triton.next_power_of_2(rank_max))


def _splits(x: torch.Tensor, shards: int, block_r: int, block_k: int, summed: bool) -> int:
    """Split K when the token tiles alone cannot fill the GPU (decode): a power of two. Where
    expand sums the partials (not `summed` by the shrink), few enough for its registers (at
    most 8192 floats a program); the H100 sweep (`bench_kernels.py --sections lora`,
    benchmarks/h100-2026-11-26-s22.md) found 32 splits of 128 columns best at 1 token and at
    32 tokens of 4 adapters once the shrink sums."""
    block_m = _block_m(x.shape[0], block_r)
    programs = triton.cdiv(x.shape[0], block_m) * shards
    want = min(triton.cdiv(2 * num_sms(x.device, 4), programs), triton.cdiv(x.shape[1], block_k))
    if not summed:
        want = min(want, 8192 // (block_m * block_r))
    return 1 << (max(want, 1).bit_length() - 1)


def _precision(dtype: torch.dtype) -> str:
    """tf32 would cost float32 models their accuracy; half types ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


_BLOCK_N = 64


def _block_k(block_r: int, itemsize: int) -> int:
    """K per iteration: a tile of A of at most 16 KiB (shared memory holds a few in flight)."""
    return max(16, min(128, 16384 // (block_r * itemsize)))


def _shrink_triton(x, a, ranks, meta, norm):
    num_tokens, k = x.shape
    slots, width, _ = a.shape
    shards = ranks.shape[1]
    rank_max = width // shards
    block_r = _block_r(rank_max)
    block_k = _block_k(block_r, x.element_size())
    block_m = _block_m(num_tokens, block_r)
    tiles = triton.cdiv(num_tokens, block_m)
    sums = SUM_SPLITS and tiles * shards * meta.num_active <= SPLIT_COUNTS
    split = _splits(x, shards, block_r, block_k, sums)
    summed = sums and split > 1
    out = torch.empty(split, num_tokens, width + (norm is not None), dtype=torch.float32,
                      device=x.device)  # fmt: skip
    if num_tokens == 0:
        return out
    assert x.stride(1) == 1 and a.is_contiguous()
    grid = (tiles * split, shards, meta.num_active)
    # its own counts: lora/layer.py runs the shrink on a side stream, beside the projection
    sem = split_counts(x.device, "LoRA shrink", side=True) if summed else x
    residual, norm_weight, _ = norm if norm is not None else (None, None, None)
    assert residual is None or (residual.shape == x.shape and residual.stride(1) == 1)
    stride_r = 0 if residual is None else residual.stride(0)
    tail = (k, shards, x.stride(0), a.stride(0), out.stride(0), out.stride(1), stride_r)
    constexprs = dict(R=rank_max, SPLIT=split, BLOCK_M=block_m, BLOCK_R=block_r,
                      BLOCK_K=block_k, PRECISION=_precision(x.dtype), SUM=summed,
                      NORM=norm is not None, ADD_IN=residual is not None)  # fmt: skip
    _launch(_shrink_kernel, grid, tail, constexprs, num_head=11).run(
        grid, x, a, ranks, out, meta.token_indices, meta.slots, meta.starts, meta.counts, sem,
        x if residual is None else residual, x if norm_weight is None else norm_weight,
    )  # fmt: skip
    return out[:1] if summed else out


def _expand_triton(partials, b, ranks, offsets, y, meta, norm_eps):
    num_tokens = y.shape[0]
    if num_tokens == 0:
        return
    shards, rank_max = ranks.shape[1], b.shape[2]
    assert y.stride(1) == 1 and b.is_contiguous() and partials.stride(2) == 1
    assert offsets[0] == 0 and len(offsets) == shards + 1 <= 4
    ends = [*offsets[1:], *[offsets[-1]] * (4 - len(offsets))]
    widest = max(hi - lo for lo, hi in zip(offsets[:-1], offsets[1:], strict=True))
    n_tiles = triton.cdiv(widest, _BLOCK_N)
    block_r = _block_r(rank_max)
    block_m = _block_m(num_tokens, block_r)
    grid = (triton.cdiv(num_tokens, block_m) * n_tiles, shards, meta.num_active)
    tail = (*ends, n_tiles, shards, partials.stride(0), partials.stride(1), b.stride(0),
            y.stride(0), 0.0 if norm_eps is None else norm_eps)  # fmt: skip
    constexprs = dict(R=rank_max, SPLIT=partials.shape[0], BLOCK_M=block_m, BLOCK_N=_BLOCK_N,
                      BLOCK_R=block_r, PRECISION=_precision(y.dtype),
                      NORM=norm_eps is not None)  # fmt: skip
    _launch(_expand_kernel, grid, tail, constexprs).run(
        grid, partials, b, ranks, y, meta.token_indices, meta.slots, meta.starts, meta.counts
    )


def _expand_silu_triton(partials, b, ranks, offsets, y, meta, norm_eps):
    num_tokens, half = y.shape[0], offsets[1]
    act = y.new_empty(num_tokens, half)
    if num_tokens == 0:
        return act
    shards, rank_max = ranks.shape[1], b.shape[2]
    assert shards == 2 and y.stride(1) == 1 and b.is_contiguous() and partials.stride(2) == 1
    n_tiles = triton.cdiv(half, _BLOCK_N)
    block_r = _block_r(rank_max)
    block_m = _block_m(num_tokens, block_r)
    grid = (triton.cdiv(num_tokens, block_m) * n_tiles, 1, meta.num_active)
    tail = (half, n_tiles, shards, partials.stride(0), partials.stride(1), b.stride(0),
            y.stride(0), act.stride(0), 0.0 if norm_eps is None else norm_eps)  # fmt: skip
    constexprs = dict(R=rank_max, SPLIT=partials.shape[0], BLOCK_M=block_m, BLOCK_N=_BLOCK_N,
                      BLOCK_R=block_r, PRECISION=_precision(y.dtype),
                      NORM=norm_eps is not None)  # fmt: skip
    _launch(_expand_silu_kernel, grid, tail, constexprs, num_head=9).run(
        grid, partials, b, ranks, y, act, meta.token_indices, meta.slots, meta.starts,
        meta.counts,
    )  # fmt: skip
    return act


_launches: dict[tuple, Launch] = {}  # eager calls skip Triton's Python launch path


def _launch(kernel, grid: tuple, tail: tuple, constexprs: dict, num_head: int = 8) -> Launch:
    """The cached launch of kernel for these trailing arguments and constexprs (the first
    num_head arguments, the tensors, are given per call)."""
    key = (kernel, tail, *constexprs.values(), interpreting())
    launch = _launches.get(key)
    if launch is None:
        pdl = pdl_options()
        launch = _launches[key] = Launch(
            kernel, grid, num_head=num_head, tail=tail,
            constexprs={**constexprs, "PDL": pdl["PDL"]}, launch_pdl=pdl["launch_pdl"],
        )  # fmt: skip
    return launch
