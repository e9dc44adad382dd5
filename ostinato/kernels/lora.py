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

Graph-safe: the grid depends on the padded token count and the padded number of groups (both
fixed by the batch descriptor), every count and index is read on the device, and spare
programs exit. Tokens of no group (no adapter, padding) are neither read nor written.

Both kernels take programmatic dependent launch (Hopper): what was written before the step
(the groups, the slots' weights) is read while the kernel before still runs; what that kernel
writes (x, y, partials) only after gdc_wait. At batch 1 the chain of dependent reads (group,
slot, rank, token) was most of each kernel's time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.context import LoRAMetadata
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
from ostinato.kernels.small_batch import arrive, gather

# the shrink's last split sums the partials, so expand reads one [T, shards * R] (an A/B switch
# for benches: else every expand program reads all SPLIT partials of its tokens)
SUM_SPLITS = True


def lora_shrink(x: torch.Tensor, a: torch.Tensor, ranks: torch.Tensor, meta: LoRAMetadata):
    """x [T, K], a [slots, shards * R, K] -> float32 partial sums [splits, T, shards * R] (one
    split, the whole sum, with SUM_SPLITS); rows of tokens outside every group are left
    unwritten."""
    if use_triton(x):
        return _shrink_triton(x, a, ranks, meta)
    return lora_shrink_torch(x, a, ranks, meta)


def lora_expand(
    partials: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor,
    offsets: tuple[int, ...],
    y: torch.Tensor,
    meta: LoRAMetadata,
) -> None:
    """y [T, N] += the adapter term of every grouped token; partials from lora_shrink, b
    [slots, N, R]; shard s owns columns offsets[s]:offsets[s + 1] (at most 3 shards)."""
    if use_triton(y):
        _expand_triton(partials, b, ranks, offsets, y, meta)
    else:
        lora_expand_torch(partials, b, ranks, offsets, y, meta)


def _groups(meta: LoRAMetadata):
    """(slot, token indices) of each non-empty group, on the host: for the torch versions."""
    counts, starts, slots = meta.counts.tolist(), meta.starts.tolist(), meta.slots.tolist()
    for count, start, slot in zip(counts, starts, slots, strict=True):
        if count:
            yield slot, meta.token_indices[start : start + count].long()


def lora_shrink_torch(x, a, ranks, meta):
    partials = torch.zeros(1, x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot, tokens in _groups(meta):
        partials[0, tokens] = x[tokens].float() @ a[slot].float().T
    return partials


def lora_expand_torch(partials, b, ranks, offsets, y, meta):
    rank_max = b.shape[2]
    summed = partials.sum(dim=0)
    for slot, tokens in _groups(meta):
        for s, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
            part = summed[tokens, s * rank_max : (s + 1) * rank_max].to(b.dtype).float()
            y[tokens, lo:hi] = (y[tokens, lo:hi].float() + part @ b[slot, lo:hi].float().T).to(
                y.dtype
            )


# ---- Triton ---------------------------------------------------------------------------------


@jit(do_not_specialize=["num_shards"])  # one compiled variant for every projection
def _shrink_kernel(
    x_ptr, a_ptr, ranks_ptr, out_ptr, tokens_ptr, slots_ptr, starts_ptr, counts_ptr, sem_ptr,
    K, num_shards, stride_x, stride_a, stride_split, stride_out,
    R: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, SUM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (token tile * SPLIT, shard, group): one split of K for BLOCK_M tokens of a group.
    SUM: the last split of each (tile, shard, group) to finish sums the SPLIT partials in split
    order into split 0's place (kernels/small_batch.py's count at sem_ptr)."""
    tile = tl.program_id(0) // SPLIT
    split = tl.program_id(0) % SPLIT
    shard = tl.program_id(1)
    group = tl.program_id(2)
    count = tl.load(counts_ptr + group)
    slot = tl.load(slots_ptr + group).to(tl.int64)
    start = tl.load(starts_ptr + group)
    if tile * BLOCK_M >= count:
        return
    rank = tl.load(ranks_ptr + slot * num_shards + shard)
    if rank == 0:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < count
    token = tl.load(tokens_ptr + start + rows, mask=row_ok, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    a_rows = a_ptr + slot * stride_a + (shard * R + r)[None, :] * K
    span = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
    k_lo = split * span
    k = k_lo + tl.arange(0, BLOCK_K)
    at = tl.load(a_rows + k[:, None], mask=(r < rank)[None, :] & (k < K)[:, None], other=0.0)
    if PDL:  # the first tile of A came in while the kernel before ran; x is its output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + span, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        if k0 != k_lo:
            at = tl.load(a_rows + k[:, None], mask=(r < rank)[None, :] & k_ok[:, None], other=0.0)
        xt = tl.load(
            x_ptr + token[:, None] * stride_x + k[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc += tl.dot(xt, at, input_precision=PRECISION)
    out = out_ptr + token[:, None] * stride_out + (shard * R + r)[None, :]
    ok = row_ok[:, None] & (r < R)[None, :]
    tl.store(out + split * stride_split, acc, mask=ok)
    if SUM:
        tiles = tl.num_programs(0) // SPLIT
        sem = sem_ptr + (group * tl.num_programs(1) + shard) * tiles + tile
        last = arrive(sem, SPLIT)
        ok = tl.where(last, ok, False)  # (the interpreter's ok & last would be integers)
        tl.store(out, gather(out, stride_split, ok, SPLIT), mask=ok)
        tl.store(sem, 0, mask=last)


@jit(do_not_specialize=["num_shards"])
def _expand_kernel(
    p_ptr, b_ptr, ranks_ptr, y_ptr, tokens_ptr, slots_ptr, starts_ptr, counts_ptr,
    end_0, end_1, end_2, n_tiles, num_shards, stride_split, stride_p, stride_b, stride_y,
    R: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (token tile * n_tiles, shard, group): BLOCK_N output columns of one shard for
    BLOCK_M tokens of a group; the SPLIT partials are summed here. Shard s ends at column
    end_s and starts where the one before it ends."""
    tile_m = tl.program_id(0) // n_tiles
    tile_n = tl.program_id(0) % n_tiles
    shard = tl.program_id(1)
    group = tl.program_id(2)
    count = tl.load(counts_ptr + group)
    slot = tl.load(slots_ptr + group).to(tl.int64)
    start = tl.load(starts_ptr + group)
    if tile_m * BLOCK_M >= count:
        return
    n_hi = tl.where(shard == 0, end_0, tl.where(shard == 1, end_1, end_2))
    n_lo = tl.where(shard == 0, 0, tl.where(shard == 1, end_0, end_1)) + tile_n * BLOCK_N
    if n_lo >= n_hi:
        return
    rank = tl.load(ranks_ptr + slot * num_shards + shard)
    if rank == 0:
        return
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < count
    token = tl.load(tokens_ptr + start + rows, mask=row_ok, other=0).to(tl.int64)
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
    y = y_ptr + token[:, None] * stride_y + n[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    out = tl.load(y, mask=mask, other=0.0).to(tl.float32)
    out += tl.dot(tl.sum(p, axis=0).to(bt.dtype), bt, input_precision=PRECISION)
    tl.store(y, out.to(y_ptr.dtype.element_ty), mask=mask)


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


def _shrink_triton(x, a, ranks, meta):
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
    out = torch.empty(split, num_tokens, width, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    assert x.stride(1) == 1 and a.is_contiguous()
    grid = (tiles * split, shards, meta.num_active)
    # its own counts: lora/layer.py runs the shrink on a side stream, beside the projection
    sem = split_counts(x.device, "LoRA shrink", side=True) if summed else x
    tail = (k, shards, x.stride(0), a.stride(0), out.stride(0), out.stride(1))
    constexprs = dict(R=rank_max, SPLIT=split, BLOCK_M=block_m, BLOCK_R=block_r,
                      BLOCK_K=block_k, PRECISION=_precision(x.dtype), SUM=summed)  # fmt: skip
    _launch(_shrink_kernel, grid, tail, constexprs, num_head=9).run(
        grid, x, a, ranks, out, meta.token_indices, meta.slots, meta.starts, meta.counts, sem
    )
    return out[:1] if summed else out


def _expand_triton(partials, b, ranks, offsets, y, meta):
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
            y.stride(0))  # fmt: skip
    constexprs = dict(R=rank_max, SPLIT=partials.shape[0], BLOCK_M=block_m, BLOCK_N=_BLOCK_N,
                      BLOCK_R=block_r, PRECISION=_precision(y.dtype))  # fmt: skip
    _launch(_expand_kernel, grid, tail, constexprs).run(
        grid, partials, b, ranks, y, meta.token_indices, meta.slots, meta.starts, meta.counts
    )


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
