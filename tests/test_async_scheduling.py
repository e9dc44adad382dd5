"""Async scheduling: the next step is scheduled and launched while the last one is in flight.
Its outputs must equal the synchronous engine's on every workload, it must really overlap, and
nothing (blocks, in-flight counts) may leak when requests stop, abort or fail in flight."""

import random

import pytest
from helpers import make_hf_checkpoint, overlapped_submits

from ostinato import LLM, SamplingParams
from ostinato.cli import main
from ostinato.config import EngineConfig


def workload(llm: LLM) -> list[tuple]:
    """Short and chunked prompts, greedy and seeded sampling, logprobs, stops by length and by
    EOS, more requests than max_num_seqs."""
    g = random.Random(0)
    prompts = [[g.randrange(3, 250) for _ in range(g.choice([3, 17, 40, 130]))] for _ in range(10)]
    params = [
        SamplingParams(
            temperature=0.0 if i % 3 else 0.8,
            seed=i,
            max_tokens=1 + 4 * i,
            ignore_eos=i % 2 == 0,
            logprobs=2 if i % 4 == 0 else None,
        )
        for i in range(10)
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.token_ids, o.finish_reason, o.logprobs) for o in outs]


def assert_same(got: list[tuple], want: list[tuple]) -> None:
    for (tokens, reason, logprobs), (tokens_w, reason_w, logprobs_w) in zip(got, want, strict=True):
        assert (tokens, reason) == (tokens_w, reason_w)
        assert (logprobs is None) == (logprobs_w is None)
        for entry, entry_w in zip(logprobs or [], logprobs_w or [], strict=True):
            assert entry.keys() == entry_w.keys()
            assert all(entry[t] == pytest.approx(entry_w[t], abs=1e-5) for t in entry)


def assert_nothing_leaked(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.scheduler.in_flight
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for seq in engine.requests.values():
        assert seq.num_in_flight_tokens == seq.num_pending_tokens == 0


SHAPES = {
    "chunked": {"max_num_batched_tokens": 48, "max_num_seqs": 4},
    "preempting": {"num_kv_blocks": 14, "max_num_seqs": 6, "max_model_len": 200},
}


@pytest.mark.parametrize("shape", SHAPES)
def test_async_equals_sync_on_tiny(shape):
    kw = {"device": "cpu", "max_model_len": 256, **SHAPES[shape]}
    want = workload(LLM("tiny", async_scheduling=False, **kw))
    llm = LLM("tiny", async_scheduling=True, **kw)
    seen = overlapped_submits(llm)
    assert_same(workload(llm), want)
    assert seen.count(1) > len(seen) // 2  # most steps were launched behind another
    assert_nothing_leaked(llm)
    if shape == "preempting":
        assert llm.stats()["num_preemptions"] > 0


def test_async_equals_sync_on_a_saved_llama(tmp_path):
    path = str(make_hf_checkpoint("llama", tmp_path / "llama"))
    kw = {"device": "cpu", "dtype": "float32", "max_num_batched_tokens": 64}
    want = workload(LLM(path, async_scheduling=False, **kw))
    llm = LLM(path, async_scheduling=True, **kw)
    assert_same(workload(llm), want)
    assert_nothing_leaked(llm)


def test_no_token_past_a_stop_while_the_next_step_is_in_flight():
    llm = LLM("tiny", device="cpu", max_model_len=256, async_scheduling=True)
    base = llm.generate(["xyz"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stop_id = base[0].token_ids[4]
    first = base[0].token_ids.index(stop_id)
    out = llm.generate(
        ["xyz", "other prompt"],
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id], ignore_eos=True),
        use_tqdm=False,
    )
    assert out[0].token_ids == base[0].token_ids[: first + 1] and out[0].finish_reason == "stop"
    assert_nothing_leaked(llm)


def test_requests_ending_at_max_model_len_never_outgrow_their_block_table():
    llm = LLM("tiny", device="cpu", max_model_len=40, async_scheduling=True)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    outs = llm.generate([[5] * 38, [6] * 39, [7] * 20], params, use_tqdm=False)
    assert [len(o.prompt_token_ids) + len(o.token_ids) for o in outs] == [40, 40, 40]
    assert {o.finish_reason for o in outs} == {"length"}
    assert_nothing_leaked(llm)


def test_abort_while_in_flight_frees_everything():
    llm = LLM("tiny", device="cpu", max_model_len=256, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in ("one", "two", "three")]
    for _ in range(3):
        engine.step()
    assert engine.in_flight  # the next step is on its way
    engine.abort_request(ids[1])
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert ids[1] not in {o.request_id for o in outputs}
    assert sorted(o.request_id for o in outputs if o.finished) == sorted([ids[0], ids[2]])
    assert_nothing_leaked(llm)


def test_a_failing_step_drops_every_step_in_flight(monkeypatch):
    llm = LLM("tiny", device="cpu", max_model_len=256, async_scheduling=True)
    engine = llm.engine
    calls = []
    launch = engine.runner.launch

    def fail_third(step):
        calls.append(step)
        if len(calls) == 3:
            raise RuntimeError("device fell over")
        return launch(step)

    monkeypatch.setattr(engine.runner, "launch", fail_third)
    with pytest.raises(RuntimeError, match="fell over"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    monkeypatch.undo()
    assert_nothing_leaked(llm)
    out = llm.generate(["again"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 3


def test_auto_is_on_only_where_it_works():
    assert EngineConfig(device="cpu").async_scheduling is False
    assert EngineConfig(device="cuda").async_scheduling is True
    spec = {"speculative_method": "ngram", "num_speculative_tokens": 2}
    assert EngineConfig(device="cuda", **spec).async_scheduling is True
    for kw in ({"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}):
        assert EngineConfig(device="cuda", **kw).async_scheduling is False  # asked for there
        assert EngineConfig(device="cpu", async_scheduling=True, **kw).async_scheduling
    with pytest.raises(ValueError, match="must be True, False or None"):
        EngineConfig(device="cpu", async_scheduling="yes")


SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 3}


def spec_prompts(llm: LLM, repeats: bool) -> list[list[int]]:
    """With repeats: X + A + X, where A is the model's greedy answer to X, so the answer
    repeats a span of the prompt. Without: distinct tokens, which nothing can match."""
    g = random.Random(1)
    if not repeats:
        return [g.sample(range(3, 250), 60) for _ in range(4)]
    xs = [[g.randrange(3, 250) for _ in range(24)] for _ in range(4)]
    answers = llm.generate(xs, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    return [x + a.token_ids + x for x, a in zip(xs, answers, strict=True)]


@pytest.mark.parametrize("repeats", [True, False])
def test_speculation_with_async_scheduling(repeats):
    """Drafts are verified in step with the whole context (the batch waits for the token in
    flight), plain steps overlap; either way the tokens are those of decoding without drafts."""
    kw = {"device": "cpu", "max_model_len": 256}
    plain = LLM("tiny", async_scheduling=False, **kw)
    prompts = spec_prompts(plain, repeats)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    if not repeats:  # sampled answers, and matches of 3 tokens at least: nothing to draft
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=30, ignore_eos=True)
                  for i in range(len(prompts))]  # fmt: skip
        kw["ngram_min"] = 3
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM("tiny", async_scheduling=True, **kw, **SPEC)
    seen = overlapped_submits(llm)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    stats = llm.stats()
    if repeats:
        assert stats["spec_accepted_tokens"] > 0
    else:
        assert stats["spec_draft_tokens"] == 0
        assert seen.count(1) > len(seen) // 2  # nothing to draft: every step overlapped
    assert_nothing_leaked(llm)


def test_cli_flag(capsys):
    assert main(["explain", "--json", "--async-scheduling", "on"]) == 0
    assert '"async_scheduling": true' in capsys.readouterr().out
    assert main(["explain", "--async-scheduling", "maybe"]) == 2
    assert "'auto', 'on' or 'off'" in capsys.readouterr().err
