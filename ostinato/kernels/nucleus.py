"""Top-p (nucleus) masking without sorting the vocabulary.

A row keeps token i when the probability mass of the tokens more likely than i is below the
row's top_p. With f(x) the mass of the probabilities above x, f falls as x grows, so the kept
tokens are those whose probability is at least the threshold t = min{x : f(x) < top_p}, which
is one of the row's probabilities. For x >= 0 a float32's bits, read as an int32, grow with
it, so the kernel searches the threshold over those integers: each pass over the row counts
f at SPLITS points spread over the interval left and keeps the part where f crosses top_p, so
PASSES passes narrow the 2^30 candidates to one. One program handles a row, reading it from
memory once a pass: ~1.2 ms whatever the rows up to a wave of SMs, so below KERNEL_MIN_ROWS
rows a sort is faster (H100, 151,936 logits a row, ms: 1 row sort 0.24 / kernel 1.17; 64 rows
1.51 / 1.42; 128 rows 3.26 / 1.70; 256 rows 5.21 / 1.94; benchmarks/h100-2026-11-26-s26.md).
"""

from __future__ import annotations

import torch
import triton.language as tl

from ostinato.kernels.dispatch import interpreting, jit, use_triton
from ostinato.kernels.launch import Launch

SPLITS = 8  # points where a pass evaluates f: each pass keeps 1/9 of the interval (4-32 timed)
PASSES = 10  # ceil(x / 9) ten times takes the 2^30 bit patterns of [0, 1] down to one
KERNEL_MIN_ROWS = 64  # on the GPU, fewer rows are sorted (faster there)
ONE_BITS = 0x3F800000  # 1.0f as int32: f(1) = 0 < top_p, so the threshold is at most 1


def top_p_mask(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] (float32; -inf for tokens already excluded) with every token
    outside each row's nucleus set to -inf; top_p [rows] float32 on the same device (1.0
    keeps the row as it is)."""
    if use_triton(logits) and (len(logits) >= KERNEL_MIN_ROWS or not logits.is_cuda):
        return _top_p_mask_triton(logits, top_p)  # the interpreter runs it at any row count
    return top_p_mask_torch(logits, top_p)


def top_p_mask_torch(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The same mask by a sort of each row."""
    ranked, order = logits.sort(dim=-1, descending=True)
    probs = ranked.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs >= top_p[:, None]) & (top_p[:, None] < 1.0)
    return torch.empty_like(logits).scatter_(1, order, ranked.masked_fill(drop, float("-inf")))


@jit
def _top_p_kernel(
    logits_ptr, out_ptr, top_p_ptr, vocab, stride_in, stride_out,
    BLOCK: tl.constexpr, SPLITS: tl.constexpr, PASSES: tl.constexpr, ONE_BITS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    src = logits_ptr + row * stride_in
    dst = out_ptr + row * stride_out
    top_p = tl.load(top_p_ptr + row)
    cols = tl.arange(0, BLOCK)
    # softmax's max and normaliser in one pass (online)
    peak = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(src + start + cols, mask=start + cols < vocab, other=float("-inf"))
        peak_so_far = tl.maximum(peak, tl.max(x, axis=0))
        shift = tl.where(peak_so_far == float("-inf"), 0.0, peak_so_far)  # -inf - -inf is NaN
        total = total * tl.exp(peak - shift) + tl.sum(tl.exp(x - shift), axis=0)
        peak = peak_so_far
    # the threshold's bits lie in (low, high]: f(low) >= top_p > f(high); top_p 1 keeps all
    low = tl.full((), -1, tl.int32)
    high = tl.where(top_p < 1.0, ONE_BITS, 0).to(tl.int32)
    k = tl.arange(0, SPLITS)
    for _ in range(PASSES):
        step = (high - low + SPLITS) // (SPLITS + 1)  # the points cover the whole interval
        points = low + (k + 1) * step
        inside = points < high
        above = tl.zeros((SPLITS,), tl.float32)  # f at each point
        for start in range(0, vocab, BLOCK):
            x = tl.load(src + start + cols, mask=start + cols < vocab, other=float("-inf"))
            p = tl.exp(x - peak) / total
            hit = p.to(tl.int32, bitcast=True)[:, None] > points[None, :]
            above += tl.sum(tl.where(hit, p[:, None], 0.0), axis=0)
        # f falls along the points: the first below top_p is the new high, the one before it
        # (if any) the new low
        first = tl.min(tl.where(inside & (above < top_p), k, SPLITS), axis=0)
        last = tl.max(tl.where(inside & (k < first), k, -1), axis=0)
        high = tl.where(first < SPLITS, low + (first + 1) * step, high)
        low = tl.where(last >= 0, low + (last + 1) * step, low)
    for start in range(0, vocab, BLOCK):
        mask = start + cols < vocab
        x = tl.load(src + start + cols, mask=mask, other=float("-inf"))
        bits = (tl.exp(x - peak) / total).to(tl.int32, bitcast=True)
        tl.store(dst + start + cols, tl.where(bits >= high, x, float("-inf")), mask=mask)


def _top_p_mask_triton(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    out = torch.empty_like(logits)
    rows, vocab = logits.shape
    if rows == 0:
        return out
    key = (vocab, logits.stride(0), out.stride(0), interpreting())
    launch = _launches.get(key)
    if launch is None:
        block = 64 if interpreting() else 1024
        launch = _launches[key] = Launch(
            _top_p_kernel, (rows, 1, 1), num_head=3, tail=key[:3],
            constexprs=dict(BLOCK=block, SPLITS=SPLITS, PASSES=PASSES, ONE_BITS=ONE_BITS),
            num_warps=8,
        )  # fmt: skip
    launch.run((rows, 1, 1), logits, out, top_p)
    return out


_launches: dict[tuple, Launch] = {}  # eager calls skip Triton's Python launch path
