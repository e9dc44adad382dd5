"""A step's inputs scattered from one packed buffer into the persistent buffers.

The host writes a step's token and request fields back to back into one pinned buffer, which
one copy takes to the device; one kernel then writes each field where the graphs read it. On the
H100's host `InputBuffers.load` took 83-85 µs for a 512-token prompt and 94-116 µs for a
32-request decode step with a copy per field (seven), 39-43 and 39-73 µs this way
(benchmarks/h100-2026-11-27-s30.md).

Packed layout (int64): a header of HEADER sizes (tokens, requests, logits rows, block-table
rows, block-table width), then input_ids, positions and slot_mapping (tokens each),
logits_indices (rows), query_start_loc (requests + 1), seq_lens (requests) and the block
table's first rows (rows x width, row-major).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ostinato.kernels.dispatch import jit, use_triton
from ostinato.kernels.launch import Launch

HEADER = 5
BLOCK = 1024  # packed values per program

# the destination fields, in packed order; each is a 1-D buffer but the 2-D block table
TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping")
FIELDS = (*TOKEN_FIELDS, "logits_indices", "query_start_loc", "seq_lens", "block_table")


def packed_size(max_tokens: int, max_reqs: int, max_blocks: int) -> int:
    """Room for the largest step: logits rows are at most one per token."""
    return HEADER + 4 * max_tokens + 2 * max_reqs + 1 + max_reqs * max_blocks


class Unpack:
    """unpack(packed, header) scatters a packed step into `buffers` (name -> tensor, FIELDS'
    dtypes and sizes) on packed's device; packed holds at least HEADER + the payload."""

    def __init__(self, packed: torch.Tensor, buffers: dict[str, torch.Tensor]) -> None:
        self.buffers = buffers
        self.launch = None
        if use_triton(packed):
            table = buffers["block_table"]
            self.launch = Launch(
                _unpack_kernel, (1, 1, 1), num_head=1,
                tail=(*(buffers[name] for name in FIELDS), table.stride(0)),
                constexprs=dict(HEADER=HEADER, BLOCK=BLOCK),
            )  # fmt: skip

    def __call__(self, packed: torch.Tensor, header: Sequence[int], payload: int) -> None:
        """header: the packed header's values, as the host wrote them; payload: the values
        after it."""
        if self.launch is None:
            return unpack_torch(packed, header, self.buffers)
        self.launch.run((triton.cdiv(payload, BLOCK), 1, 1), packed)


def unpack_torch(
    packed: torch.Tensor, header: Sequence[int], buffers: dict[str, torch.Tensor]
) -> None:
    tokens, reqs, rows, table_rows, width = (int(v) for v in header)
    sizes = {name: tokens for name in TOKEN_FIELDS}
    sizes |= {"logits_indices": rows, "query_start_loc": reqs + 1, "seq_lens": reqs}
    start = HEADER
    for name, size in sizes.items():
        buffers[name][:size] = packed[start : start + size]
        start += size
    values = packed[start : start + table_rows * width].view(table_rows, width)
    buffers["block_table"][:table_rows, :width] = values


@jit
def _unpack_kernel(
    packed_ptr, ids_ptr, positions_ptr, slots_ptr, logits_ptr, starts_ptr, lens_ptr, table_ptr,
    stride_table, HEADER: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid: the payload in BLOCK values a program. Each value goes to the one field whose span
    of the payload holds it (j: its index there, negative before the span)."""
    tokens = tl.load(packed_ptr)
    reqs = tl.load(packed_ptr + 1)
    rows = tl.load(packed_ptr + 2)
    table_rows = tl.load(packed_ptr + 3)
    width = tl.load(packed_ptr + 4)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    size = 3 * tokens + rows + 2 * reqs + 1 + table_rows * width
    value = tl.load(packed_ptr + HEADER + i, mask=i < size)
    j = i
    tl.store(ids_ptr + j, value, mask=j < tokens)
    j -= tokens
    tl.store(positions_ptr + j, value, mask=(j >= 0) & (j < tokens))
    j -= tokens
    tl.store(slots_ptr + j, value, mask=(j >= 0) & (j < tokens))
    j -= tokens
    tl.store(logits_ptr + j, value, mask=(j >= 0) & (j < rows))
    j -= rows
    tl.store(starts_ptr + j, value.to(tl.int32), mask=(j >= 0) & (j <= reqs))
    j -= reqs + 1
    tl.store(lens_ptr + j, value.to(tl.int32), mask=(j >= 0) & (j < reqs))
    j -= reqs
    in_table = (j >= 0) & (j < table_rows * width)
    j = tl.where(in_table, j, 0)
    row, column = j // tl.maximum(width, 1), j % tl.maximum(width, 1)
    tl.store(table_ptr + row * stride_table + column, value.to(tl.int32), mask=in_table)
