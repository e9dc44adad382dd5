"""The greedy token of each logits row: torch's argmax (the first index of the largest value; a
NaN counts as larger than any number, so the first NaN where a row has one), split over
programs.

torch's argmax reads a row of llama-3.1-8b's vocabulary with few blocks: 26 µs for its
256 KB of bf16 logits on the H200 (8 for Qwen3's larger one), where this kernel takes 2.2
(benchmarks/h200-2026-11-28-s41.md). Here each row's vocabulary is split in chunks of CHUNK
over programs; each stores its chunk's best (value, index), and the last of the row's
programs to finish (its count, as the split GEMVs count: kernels/small_batch.py) picks the
row's best of those.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.kernels.dispatch import SPLIT_COUNTS, jit, pdl_options, split_counts, use_triton
from ostinato.kernels.launch import Launch
from ostinato.kernels.small_batch import arrive

CHUNK = 4096  # vocabulary entries per program: 8 KB of bf16 logits, 32 per thread
_NONE = tl.constexpr(2**31 - 1)  # an index past every vocabulary

_launches: dict[tuple, Launch] = {}


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: logits.argmax(dim=-1) of 2-D logits (torch's own on the CPU, or where a
    row's entries are not contiguous)."""
    rows, vocab = logits.shape
    if not use_triton(logits) or rows > SPLIT_COUNTS or logits.stride(1) != 1 or not rows:
        return logits.argmax(dim=-1)
    split = triton.cdiv(vocab, CHUNK)
    # new_empty: the sampler calls this every step, and it allocates with less Python
    tokens = logits.new_empty(rows, dtype=torch.int64)
    values = logits.new_empty(rows, split, dtype=torch.float32)
    indices = logits.new_empty(rows, split, dtype=torch.int32)
    key = (logits.device, vocab, logits.stride(0))
    launch = _launches.get(key)
    if launch is None:
        launch = _launches[key] = _launch(vocab, logits.stride(0), split)
    counts = split_counts(logits.device, "argmax")
    launch.run((rows, split, 1), logits, values, indices, tokens, counts)
    return tokens


def _launch(vocab: int, stride: int, split: int) -> Launch:
    pdl = pdl_options()
    return Launch(
        _argmax_kernel,
        (0, 0, 0),  # rows x split: run's
        num_head=5,  # logits, values, indices, tokens, counts
        tail=(vocab, stride),
        constexprs=dict(
            CHUNK=CHUNK, SPLIT=split, SPLIT_P2=triton.next_power_of_2(split), PDL=pdl["PDL"]
        ),
        num_warps=4,
        launch_pdl=pdl["launch_pdl"],
    )


@jit
def _first_best(v, idx):
    """(value, index) of the best of v: the first NaN if any (its value NaN), else the first
    largest value."""
    nan = v != v
    first_nan = tl.min(tl.where(nan, idx, _NONE), axis=0)
    top = tl.max(tl.where(nan, float("-inf"), v), axis=0)
    first_top = tl.min(tl.where(v == top, idx, _NONE), axis=0)
    has_nan = first_nan < _NONE
    return tl.where(has_nan, float("nan"), top), tl.where(has_nan, first_nan, first_top)


@jit
def _argmax_kernel(
    x_ptr, val_ptr, idx_ptr, out_ptr, sem_ptr, V, stride_x, CHUNK: tl.constexpr,
    SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (row, part): columns part * CHUNK on of the row; its best goes to
    val_ptr/idx_ptr [rows, SPLIT], and the row's last program writes the row's best index to
    out_ptr[row]. Padding reads -inf at indices past V, which lose every tie."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row, part = tl.program_id(0), tl.program_id(1)
    cols = part * CHUNK + tl.arange(0, CHUNK)
    v = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < V, other=float("-inf"))
    value, index = _first_best(v.to(tl.float32), cols)
    tl.store(val_ptr + row * SPLIT + part, value)
    tl.store(idx_ptr + row * SPLIT + part, index)
    last = arrive(sem_ptr + row, SPLIT)
    if last:
        j = tl.arange(0, SPLIT_P2)
        ok = j < SPLIT
        values = tl.load(val_ptr + row * SPLIT + j, mask=ok, other=float("-inf"),
                         cache_modifier=".cg")  # fmt: skip
        indices = tl.load(idx_ptr + row * SPLIT + j, mask=ok, other=_NONE, cache_modifier=".cg")
        tl.store(out_ptr + row, _first_best(values, indices)[1].to(tl.int64))
        tl.store(sem_ptr + row, 0)
