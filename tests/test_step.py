"""StepInput: the host-side step every rank runs, built on the driver."""

import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ostinato.engine.scheduler import ScheduledBatch
from ostinato.engine.sequence import Sequence
from ostinato.graphs.modes import BatchDescriptor, CudaGraphMode
from ostinato.lora.slots import LoRALoad
from ostinato.runner.sampler import Sampler
from ostinato.runner.step import PromptRows, SamplingRow, TokenHistory, build_step, dummy_step
from ostinato.sampling_params import SamplingParams

BS = 4


def seq(request_id, tokens, computed, blocks, params=None, prompt=None) -> Sequence:
    """tokens[:prompt] the prompt (default: all of them), the rest its outputs."""
    prompt = len(tokens) if prompt is None else prompt
    s = Sequence(request_id, tokens[:prompt], params or SamplingParams(), eos_token_id=2)
    s.token_ids += tokens[prompt:]
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
    assert_buffer_dtypes(step)
    assert step.lora_slots is None and step.lora_loads == () and step.prompt_rows == []
    assert step.placeholder_tokens is None and step.placeholder_rows is None


def assert_buffer_dtypes(step) -> None:
    """The input buffers' dtypes, which the host mirror takes without a conversion."""
    int64 = ("input_ids", "positions", "slot_mapping", "logits_indices")
    assert all(getattr(step, name).dtype == np.int64 for name in int64)
    int32 = ("query_start_loc", "seq_lens", "block_table")
    assert all(getattr(step, name).dtype == np.int32 for name in int32)


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
    assert step.sampling == [] and step.lora_slots is None
    assert (step.mode, step.desc) == (CudaGraphMode.NONE, BatchDescriptor(10, 3, None, 0))
    assert step.input_ids.tolist() == step.positions.tolist() == [0] * 10
    assert step.seq_lens.tolist() == [4, 3, 3]
    assert_buffer_dtypes(step)


def test_dummy_steps_clamp_lengths_to_the_model_and_cycle_adapter_slots():
    step = dummy_step(num_tokens=9, num_reqs=2, max_model_len=3, block_size=BS, num_loras=2)
    assert step.query_start_loc.tolist() == [0, 5, 9]
    assert step.seq_lens.tolist() == [3, 3]  # past the model's length: clamped
    assert step.block_table.shape == (2, 1)
    assert step.lora_slots.tolist() == [0, 1] and step.desc == BatchDescriptor(9, 2, None, 2)
    three = dummy_step(num_tokens=3, num_reqs=3, max_model_len=8, block_size=BS, num_loras=2)
    assert three.lora_slots.tolist() == [0, 1, 0] and three.lora_slots.dtype == np.int32
    assert three.desc == BatchDescriptor(3, 3, 1, 2)  # an even cut: uniform, as a live step's


def test_the_forward_context_holds_the_keys_uniform_query_len():
    """What attention may assume of a step's batch comes from its key, not its counts: a FULL
    graph of 4 tokens and 4 requests (mode full) replays chunks too, so its context says
    nothing is uniform, though its dummy batch is cut into single tokens; a FULL decode key
    and an eager step's own batch say q."""
    from ostinato.config import EngineConfig
    from ostinato.loader import load_hf_config
    from ostinato.runner.model_runner import ModelRunner

    hf_config = load_hf_config("tiny")
    config = EngineConfig(model="tiny", dtype="float32", device="cpu", max_num_seqs=8,
                          max_num_batched_tokens=32).for_model(hf_config)  # fmt: skip
    runner = ModelRunner(config, hf_config)
    runner.start(16)
    seen = []
    plan = runner.backend.plan
    runner.backend.plan = lambda meta: seen.append(meta.uniform_query_len) or plan(meta)
    for desc in (BatchDescriptor(4, 4, None, 0), BatchDescriptor(4, 4, 1, 0)):
        runner._fill_dummy_desc(desc)
        runner._forward_desc(desc)
    decode = seq("d", list(range(10, 16)), computed=5, blocks=[0, 1])
    runner.launch(build_step(ScheduledBatch([decode], [1]), config.block_size, eager))
    assert seen == [None, 1, 1]


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


def test_a_token_still_being_sampled_is_a_placeholder_for_the_step_in_flight():
    """Async scheduling: b's next input token is the one the step in flight samples (logits
    row 3 there, after x's row and its two drafts'), so it goes in as 0 and a placeholder; its
    penalties' history says one output token is pending."""
    a = seq("a", [10, 11, 12], computed=2, blocks=[5])
    presence = SamplingParams(presence_penalty=0.5)
    b = seq("b", [20, 21, 22], computed=2, blocks=[6], params=presence, prompt=2)
    b.num_in_flight_tokens = b.num_pending_tokens = 1  # 22 at position 2 is being computed
    batch = ScheduledBatch([a, b], [1, 1])
    params = SamplingParams()
    in_flight = [SamplingRow("x", params, 0, (5, 6)), SamplingRow("b", params, 3)]
    previous = SimpleNamespace(sampling=in_flight)
    step = build_step(batch, BS, eager, previous=previous)
    assert step.input_ids.tolist() == [12, 0]
    assert step.positions.tolist() == [2, 3] and step.seq_lens.tolist() == [3, 4]
    assert step.placeholder_tokens.tolist() == [1] and step.placeholder_rows.tolist() == [3]
    assert step.sampling[1].history == TokenHistory((20, 21), (22,), pending=True)
    assert step.sampling[1].position == 4
    with pytest.raises(ValueError, match="step in flight"):
        build_step(batch, BS, eager)


def test_penalties_read_the_history_and_min_tokens_ban_the_stop_ids():
    """A penalized request's row carries its prompt and outputs; min_tokens bans its stop ids
    (EOS included) while tokens are still owed; other rows carry neither. The row samples the
    request's 3rd output token (position 5 after a 3-token prompt), 2 given before it."""
    penalized = SamplingParams(repetition_penalty=1.3)
    owing = [SamplingParams(min_tokens=n, stop_token_ids=[9, 7]) for n in (4, 3, 2)]
    rows = []
    for params in (penalized, *owing, SamplingParams()):
        s = seq("r", [30, 31, 32, 33, 34], computed=4, blocks=[1, 8], params=params, prompt=3)
        rows += build_step(ScheduledBatch([s], [1]), BS, eager).sampling
    assert rows[0].history == TokenHistory((30, 31, 32), (33, 34), pending=False)
    assert rows[0].banned == () and rows[0].min_tokens_left == 0
    assert [(r.history, r.banned, r.min_tokens_left) for r in rows[1:4]] == [
        (None, (2, 7, 9), 2),
        (None, (2, 7, 9), 1),
        (None, (), 0),  # min_tokens reached: nothing banned
    ]
    assert rows[4] == SamplingRow("r", rows[4].params, 5)


def test_prompt_logprobs_chunks_score_their_prompt_positions_after_the_sampling_rows():
    """Each chunk's rows predict its next prompt tokens, after the sampling rows; the chunk
    that reaches the prompt's end scores up to its last prompt token and samples."""
    params = SamplingParams(prompt_logprobs=2)
    prompt = [40, 41, 42, 43, 44, 45]
    first = seq("p", prompt, computed=0, blocks=[3, 4], params=params)
    decode = seq("d", [10, 11, 12], computed=2, blocks=[5])
    step = build_step(ScheduledBatch([decode, first], [1, 3]), BS, eager)
    assert step.logits_indices.tolist() == [0, 1, 2, 3]  # d's row, then p's tokens 0-2
    assert step.prompt_rows == [PromptRows("p", 1, (41, 42, 43), 2)]
    assert step.num_sampling_rows == 1
    last = seq("p", prompt, computed=3, blocks=[3, 4], params=params)
    step = build_step(ScheduledBatch([last], [3]), BS, eager)
    assert step.logits_indices.tolist() == [2, 0, 1]  # it samples; positions 3, 4 score 44, 45
    assert step.prompt_rows == [PromptRows("p", 4, (44, 45), 2)]
    late = seq("p", prompt, computed=4, blocks=[3, 4], params=params)
    assert build_step(ScheduledBatch([late], [2]), BS, eager).prompt_rows == [
        PromptRows("p", 5, (45,), 2)
    ]
    for computed, tokens in ((5, prompt), (6, [*prompt, 46])):  # nothing left to score
        s = seq("p", tokens, computed=computed, blocks=[3, 4], params=params, prompt=6)
        assert (
            build_step(ScheduledBatch([s], [len(tokens) - computed]), BS, eager).prompt_rows == []
        )


def test_adapter_slots_go_with_the_step_and_into_the_graph_key():
    """The batch's adapters get slots (lora.assign), the step carries them and the loads, and
    dispatch sees the number of distinct adapters among the step's tokens."""
    names = ["A", None, "A", "B"]
    seqs = [seq(f"r{i}", [1, 2, 3], computed=2, blocks=[i]) for i in range(4)]
    for s, name in zip(seqs, names, strict=True):
        s.lora_name = name
    load = LoRALoad(1, "B", "/adapters/b")
    assigned = []
    lora = SimpleNamespace(
        assign=lambda n: assigned.append(n) or (np.array([0, -1, 0, 1], np.int32), (load,))
    )
    keys = []

    def dispatch(num_tokens, num_reqs, q, num_loras):
        keys.append((num_tokens, num_reqs, q, num_loras))
        return eager(num_tokens, num_reqs, q, num_loras)

    step = build_step(ScheduledBatch(seqs, [1] * 4), BS, dispatch, lora)
    assert assigned == [names] and keys == [(4, 4, 1, 2)]
    assert step.lora_slots.tolist() == [0, -1, 0, 1] and step.lora_loads == (load,)
    for s in seqs:
        s.lora_name = None
    step = build_step(ScheduledBatch(seqs, [1] * 4), BS, dispatch, lora)
    assert len(assigned) == 1 and keys[-1] == (4, 4, 1, 0) and step.lora_slots is None
