"""InputBuffers: a step written into the persistent buffers, padded to its graph's sizes, as
the graphs read them (on the CPU the device buffers are CPU tensors and copies are plain).
Every test runs twice: the packed step scattered by torch, and by the kernel (interpreted)."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from ostinato.engine.scheduler import ScheduledBatch
from ostinato.engine.sequence import Sequence
from ostinato.graphs.modes import BatchDescriptor, CudaGraphMode
from ostinato.runner.input_buffers import InputBuffers, group_by_adapter
from ostinato.runner.step import build_step
from ostinato.sampling_params import SamplingParams

BS = 4


@pytest.fixture(autouse=True, params=["torch", "kernel"])
def unpack_path(request, monkeypatch):
    if request.param == "kernel":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


def seq(request_id: str, tokens: list[int], computed: int, blocks: list[int]) -> Sequence:
    s = Sequence(request_id, tokens, SamplingParams())
    s.num_computed_tokens, s.block_ids = computed, blocks
    return s


def buffers(**lora) -> InputBuffers:
    """Room for 16 tokens and 6 requests: more than the steps here, which the graph pads to 8
    and 4 (full)."""
    return InputBuffers(max_tokens=16, max_reqs=6, max_blocks=5, device=torch.device("cpu"), **lora)


def full(num_tokens, num_reqs, q, num_loras):
    """A FULL graph of 8 tokens and 4 requests: the step is padded to both."""
    return CudaGraphMode.FULL, BatchDescriptor(8, 4, None, num_loras)


def mixed_step():
    """A decode (token 15 at position 5) and a 3-token chunk of a prompt (positions 2-4)."""
    decode = seq("d", list(range(10, 16)), computed=5, blocks=[7, 3])
    chunk = seq("c", list(range(20, 30)), computed=2, blocks=[4, 9, 1])
    return build_step(ScheduledBatch([decode, chunk], [1, 3]), BS, full)


def test_a_full_steps_padding_stores_nowhere_and_belongs_to_no_request(unpack_path):
    b = buffers()
    assert (b.unpack.launch is not None) == (unpack_path == "kernel")
    assert "lora_tokens" not in b.device  # no adapters, no adapter buffers
    for name in ("slot_mapping", "seq_lens", "query_start_loc", "logits_indices"):
        b.device[name].fill_(99)  # a previous, longer step's leftovers
    b.load(mixed_step())
    d = {name: t.tolist() for name, t in b.device.items()}
    assert d["input_ids"][:8] == [15, 22, 23, 24, 0, 0, 0, 0]
    assert d["positions"][:8] == [5, 2, 3, 4, 0, 0, 0, 0]
    assert d["slot_mapping"][:8] == [3 * BS + 1, 4 * BS + 2, 4 * BS + 3, 9 * BS, -1, -1, -1, -1]
    assert d["slot_mapping"][8:] == [99] * 8  # past the graph's size: never read, never written
    assert d["query_start_loc"] == [0, 1, 4, 4, 4, 99, 99]  # padded requests hold no tokens
    assert d["seq_lens"] == [6, 5, 0, 0, 99, 99]  # ... and no KV
    assert d["block_table"][:2] == [[7, 3, 0, 0, 0], [4, 9, 1, 0, 0]]
    assert d["logits_indices"] == [0] + [99] * 15  # one row: the decode's token


def test_slots_of_a_large_cache_arrive_exact():
    """Slots past 2**24 (a cache of millions of blocks) survive the host mirror unrounded."""
    block = 2**23 + 1
    b = buffers()
    b.load(build_step(ScheduledBatch([seq("n", [1, 2, 3], 2, [block])], [1]), BS, full))
    assert b.device["slot_mapping"][0].item() == block * BS + 2
    assert b.device["block_table"][0, 0].item() == block


def test_metadata_views_the_padded_batch():
    b = buffers()
    step = mixed_step()
    b.load(step)
    meta = b.metadata(step.padded_tokens, step.padded_reqs)
    assert (meta.num_tokens, meta.num_reqs) == (8, 4)
    assert meta.query_start_loc.tolist() == meta.query_start_loc_cpu.tolist() == [0, 1, 4, 4, 4]
    assert meta.query_start_loc_cpu.dtype == meta.seq_lens_cpu.dtype == torch.int32  # indices
    assert meta.seq_lens.tolist() == meta.seq_lens_cpu.tolist() == [6, 5, 0, 0]
    assert meta.block_table.shape == (4, 5) and meta.slot_mapping.shape == (8,)
    assert meta.query_start_loc.shape == meta.query_start_loc_cpu.shape == (5,)
    assert meta.slot_mapping.data_ptr() == b.device["slot_mapping"].data_ptr()  # views, fixed


def test_a_narrower_step_leaves_wider_rows_alone_and_reads_its_own_width():
    """Each step copies its own block-table width; a graph reads whole rows, whose tail the
    attention kernel never reaches (lengths bound it)."""
    b = buffers()
    b.load(mixed_step())
    narrow = build_step(ScheduledBatch([seq("n", [1, 2, 3], 2, [6])], [1]), BS, full)
    b.load(narrow)
    assert b.device["block_table"][:2].tolist() == [[6, 3, 0, 0, 0], [4, 9, 1, 0, 0]]
    assert b.device["seq_lens"][:4].tolist() == [3, 0, 0, 0]
    assert b.device["input_ids"][:8].tolist() == [3, 0, 0, 0, 0, 0, 0, 0]


def test_placeholders_take_the_sampled_tokens_of_the_step_in_flight():
    """Tokens the step in flight samples go into this step's input on the device: input token
    placeholder_tokens[i] takes the sample of logits row placeholder_rows[i]."""
    b = buffers()
    step = replace(
        mixed_step(),
        placeholder_tokens=np.array([0, 3], np.int64),
        placeholder_rows=np.array([2, 0], np.int64),
    )
    b.load(step)
    b.fill_placeholders(step, torch.tensor([70, 71, 72]))
    assert b.device["input_ids"][:4].tolist() == [72, 22, 23, 70]


def test_adapter_groups_list_each_slots_tokens_and_pad_to_the_graphs_count():
    tokens, slots, starts, counts = group_by_adapter(np.array([1, -1, 0, 1, 0, -1]))
    assert tokens.tolist() == [2, 4, 0, 3]  # slot 0's tokens, then slot 1's, in token order
    assert (slots.tolist(), starts.tolist(), counts.tolist()) == ([0, 1], [0, 2], [2, 2])
    many = np.random.default_rng(0).integers(-1, 3, 500)  # long enough for an unstable sort
    tokens, slots, starts, counts = group_by_adapter(many)
    for slot, start, count in zip(slots, starts, counts, strict=True):
        assert tokens[start : start + count].tolist() == np.flatnonzero(many == slot).tolist()
    b = buffers(max_loras=4)
    step = mixed_step()
    step = replace(
        step, lora_slots=np.array([2, 0], np.int32), desc=replace(step.desc, num_active_loras=3)
    )
    b.device["lora_counts"].fill_(9)
    b.load(step)
    # the decode's token 0 in slot 2; the chunk's tokens 1-3 in slot 0; a third group, empty
    assert b.device["lora_tokens"][:4].tolist() == [1, 2, 3, 0]
    assert b.device["lora_slots"][:3].tolist() == [0, 2, 0]
    assert b.device["lora_starts"][:3].tolist() == [0, 3, 0]
    assert b.device["lora_counts"].tolist() == [3, 1, 0, 9]
    meta = b.lora_metadata(8, 3)
    assert meta.num_active == 3 and meta.token_indices.shape == (8,)
    assert meta.counts.tolist() == [3, 1, 0] and meta.slots.tolist() == [0, 2, 0]
    assert meta.starts.tolist() == [0, 3, 0] and b.lora_metadata(8, 0) is None


def largest_step(first_block: int = 0):
    """Every token, request and block-table column of buffers() in use: 16 tokens over 6
    requests of 17 tokens, each with 5 blocks (numbered from first_block)."""
    lengths = [3, 3, 3, 3, 2, 2]
    seqs = [
        seq(f"r{i}", list(range(100 * i, 100 * i + 17)), 17 - q,
            [first_block + 10 * i + j for j in range(5)])
        for i, q in enumerate(lengths)
    ]  # fmt: skip
    whole = lambda *_: (CudaGraphMode.FULL, BatchDescriptor(16, 6, None, 0))
    return build_step(ScheduledBatch(seqs, lengths), BS, whole)


def test_the_largest_step_fits_the_packed_buffer():
    """Each field of the largest step arrives whole, and the packed payload fills the buffer
    but its header's spare room (one logits row per token)."""
    b = buffers()
    step = largest_step()
    b.load(step)
    assert b.device["input_ids"].tolist() == step.input_ids.tolist()
    assert b.device["slot_mapping"].tolist() == step.slot_mapping.tolist()
    assert b.device["block_table"].tolist() == step.block_table.tolist()
    assert b.device["seq_lens"].tolist() == [17] * 6
    assert b.device["query_start_loc"].tolist() == step.query_start_loc.tolist()
    assert b.device["logits_indices"][:6].tolist() == step.logits_indices.tolist()
    assert b.packed.numel() == 5 + 4 * 16 + 2 * 6 + 1 + 6 * 5
