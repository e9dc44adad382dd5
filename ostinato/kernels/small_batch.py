"""What the small-batch projection kernels (gemv.py for bf16/fp16/fp32 weights, fp8.py for FP8
ones) share: their launch configuration, weight loads, and K split over programs where a weight
has too few rows to give every SM work.

A split launch's programs each store their fp32 partial of an output tile and count themselves
in that tile's per-device count (`arrive`; the counts are dispatch.split_counts, which the MoE
kernel shares); the last of a tile's programs sums the partials in split order (`gather`: the
same sum on every run), resets the count to 0 for the next call and finishes the tile. No
program waits for another, and the count is the kernel's own: the next kernel on the stream
starts its work only after this one completes (PDL's gdc_wait included), so the two kernels
may share the counts.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from ostinato.kernels.dispatch import SPLIT_COUNTS, jit


class GemvConfig(NamedTuple):
    rows: int  # rows per program: M padded for tl.dot (16 or 32), or 1 (FMAs and a sum)
    block_n: int  # weight rows (output columns) per program
    block_k: int  # K columns per step
    span: int  # K columns per split (a multiple of block_k)
    split: int  # programs along K; their fp32 partials are summed by the last to finish
    num_warps: int
    num_stages: int
    fp8_x: bool = False  # fp8.py's tl.dot rows: x quantised to FP8 for an FP8 x FP8 dot
    swap: bool = False  # gemv.py's tl.dot rows: weight tile @ x.T (the weight rows on M)


def split_span(k: int, block_k: int, split: int, tiles: int) -> tuple[int, int]:
    """(span, split) for about `split` parts of K in whole chunks of block_k; one part where
    the launch has more output tiles than there are counts."""
    if tiles > SPLIT_COUNTS:
        split = 1
    span = triton.cdiv(triton.cdiv(k, max(1, split)), block_k) * block_k
    return span, triton.cdiv(k, span)


@jit
def load_weights(w_rows, kk, col_ok, K, EVEN: tl.constexpr):
    """Columns kk of the weight rows; EVEN: every row and column is in bounds, no masks."""
    if EVEN:
        return tl.load(w_rows + kk[None, :])
    return tl.load(w_rows + kk[None, :], mask=col_ok[:, None] & (kk < K)[None, :], other=0.0)


@jit
def arrive(sem, SPLIT: tl.constexpr):
    """Count this program at its tile's count sem, once its partials are stored; True in the
    last of the tile's SPLIT programs, which then sets the count back to 0."""
    tl.debug_barrier()  # every thread's partial stored before the count releases them
    return tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu") == SPLIT - 1


@jit
def gather(parts, stride_split, mask, SPLIT: tl.constexpr):
    """The sum of the SPLIT partials at parts + s * stride_split, in split order. .cg: from
    L2, where the other SMs wrote."""
    total = tl.load(parts, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT):
        total += tl.load(parts + s * stride_split, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@jit
def input_chunk(x_ptrs, r_ptrs, mask, ADD_IN: tl.constexpr):
    """A chunk of the input rows as the unfused kernels store it: x, or x + residual rounded
    to the dtype (the fused add + norm's sum, which a norm prologue normalises)."""
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    if ADD_IN:
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x
