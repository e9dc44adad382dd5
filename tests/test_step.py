"""StepInput: the host-side step every rank runs, built on the driver."""

import pickle

import torch

from ostinato.engine.scheduler import ScheduledBatch
from ostinato.engine.sequence import Sequence
from ostinato.graphs.modes import BatchDescriptor, CudaGraphMode
from ostinato.runner.sampler import Sampler
from ostinato.runner.step import SamplingRow, build_step, dummy_step
from ostinato.sampling_params import SamplingParams

BS = 4


def seq(request_id: str, tokens: list[int], computed: int, blocks: list[int]) -> Sequence:
    s = Sequence(request_id, tokens, SamplingParams())
    s.num_computed_tokens, s.block_ids = computed, blocks
    return s


def eager(num_tokens, num_reqs, q, num_loras):
    return CudaGraphMode.NONE, BatchDescriptor(num_tokens, num_reqs, q, num_loras)


def test_build_step_lays_out_a_mixed_batch():
    decode = seq("d", list(range(10, 16)), computed=5, blocks=[7, 3])  # 1 new token at pos 5
    chunk = seq("c", list(range(20, 30)), computed=2, blocks=[4, 9, 1])  # 3 of 8 left
    batch = ScheduledBatch([decode, chunk], [1, 3])
    step = build_step(batch, BS, eager)
    assert step.input_ids.tolist() == [15, 22, 23, 24]
    assert step.positions.tolist() == [5, 2, 3, 4]
    assert step.query_start_loc.tolist() == [0, 1, 4]
    assert step.seq_lens.tolist() == [6, 5]
    assert step.block_table.tolist() == [[7, 3, 0], [4, 9, 1]]
    # slot = block_table[req, pos // BS] * BS + pos % BS
    assert step.slot_mapping.tolist() == [3 * BS + 1, 4 * BS + 2, 4 * BS + 3, 9 * BS + 0]
    # only the decode reached its last token: one logits row, at its token
    assert step.logits_indices.tolist() == [0]
    assert step.sampling == [SamplingRow("d", decode.params, position=6)]
    assert (step.num_tokens, step.num_reqs, step.padded_tokens) == (4, 2, 4)


def test_full_steps_pad_requests_and_survive_pickling():
    seqs = [seq(f"r{i}", [1, 2, 3], computed=2, blocks=[i]) for i in range(3)]

    def full(num_tokens, num_reqs, q, num_loras):
        return CudaGraphMode.FULL, BatchDescriptor(4, 4, 1)

    step = pickle.loads(pickle.dumps(build_step(ScheduledBatch(seqs, [1, 1, 1]), BS, full)))
    assert (step.mode, step.padded_tokens, step.padded_reqs) == (CudaGraphMode.FULL, 4, 4)
    assert step.logits_indices.tolist() == [0, 1, 2]
    assert [row.request_id for row in step.sampling] == ["r0", "r1", "r2"]


def test_dummy_step_stores_nothing_and_reads_block_zero():
    step = dummy_step(num_tokens=10, num_reqs=3, max_model_len=8, block_size=BS)
    assert step.query_start_loc.tolist() == [0, 4, 7, 10]
    assert (step.slot_mapping == -1).all() and not step.block_table.any()
    assert step.block_table.shape == (3, 1) and step.logits_indices.tolist() == [3, 6, 9]
    assert not step.sampling


def test_a_seeded_requests_draws_depend_on_its_positions_alone():
    logits = torch.randn(1, 50)
    params = SamplingParams(temperature=1.0, seed=5)
    sampler = Sampler()
    first = [sampler(logits, [SamplingRow("a", params, i)]).token_ids[0][0] for i in range(8)]
    crowd = [SamplingRow(f"other{j}", SamplingParams(temperature=1.0), 0) for j in range(3)]
    for i in reversed(range(8)):  # any order, any batch, a fresh sampler: the same tokens
        rows = [*crowd[: i % 3], SamplingRow("b", params, i), *crowd[i % 3 :]]
        out = Sampler()(logits.expand(len(rows), 50), rows).token_ids
        assert out[i % 3] == [first[i]]
    assert len(set(first)) > 1  # positions draw differently
    other_seed = SamplingParams(temperature=1.0, seed=6)
    assert [sampler(logits, [SamplingRow("a", other_seed, i)]).token_ids[0][0]
            for i in range(8)] != first  # fmt: skip


def test_drafts_follow_the_last_token_and_each_gets_a_logits_row():
    a = seq("a", [10, 11, 12], computed=2, blocks=[5, 7])  # last token 12 at 2, drafts 13 14
    b = seq("b", [20, 21, 22, 23, 24], computed=4, blocks=[6, 2])  # drafts 25 26
    c = seq("c", list(range(30, 40)), computed=0, blocks=[1, 3, 4])  # a 6-token prefill chunk
    batch = ScheduledBatch([a, b, c], [3, 3, 6], [[13, 14], [25, 26], []])
    assert batch.uniform_query_len is None  # c is not a decode
    step = build_step(batch, BS, eager)
    assert step.input_ids.tolist() == [12, 13, 14, 24, 25, 26, *range(30, 36)]
    assert step.positions.tolist() == [2, 3, 4, 4, 5, 6, 0, 1, 2, 3, 4, 5]
    assert step.seq_lens.tolist() == [5, 7, 6]
    drafts_slots = [5 * BS + 2, 5 * BS + 3, 7 * BS + 0, 2 * BS + 0, 2 * BS + 1, 2 * BS + 2]
    assert step.slot_mapping[:6].tolist() == drafts_slots
    assert step.logits_indices.tolist() == [0, 1, 2, 3, 4, 5]  # c samples nothing yet
    assert [r.draft_token_ids for r in step.sampling] == [(13, 14), (25, 26)]
    assert [r.position for r in step.sampling] == [3, 5]
    assert ScheduledBatch([a, b], [3, 3], [[13, 14], [25, 26]]).uniform_query_len == 3
