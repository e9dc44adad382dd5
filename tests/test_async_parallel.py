"""Async scheduling over several processes (issue 22, CPU with gloo): the sampling rank's
tokens reach the first stage's ranks within the step, so the driver launches the next step
before the last one's tokens are back; under pipeline parallelism P + 1 batches are in
flight. Token for token the synchronous engine's; a worker killed with steps in flight stops
the engine within seconds, leaving no process."""

from __future__ import annotations

import multiprocessing

import pytest
from helpers import assert_killing_stops_the_engine, assert_stopped_for_good
from test_async_scheduling import assert_same

from ostinato import LLM, SamplingParams

ENGINE = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "max_num_seqs": 6,
          "max_num_batched_tokens": 40}  # fmt: skip
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(5 + 9 * i)] for i in range(5)]
PARAMS = [
    SamplingParams(
        temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=4 + 2 * i, ignore_eos=True,
        logprobs=2 if i == 1 else None,
    )
    for i in range(5)
]  # fmt: skip


def run(async_scheduling: bool, **parallel) -> tuple[list[tuple], int, int, int]:
    """Outputs; the most steps in flight at once; the steps launched with an input token
    still being sampled by the step before them; the draft tokens verified."""
    llm = LLM("tiny", async_scheduling=async_scheduling, **ENGINE, **parallel)
    engine, seen = llm.engine, {"most": 0, "placeholders": 0}
    submit = engine.executor.submit

    def counting(step):
        seen["most"] = max(seen["most"], len(engine.in_flight) + 1)
        seen["placeholders"] += step.placeholder_tokens is not None
        return submit(step)

    engine.executor.submit = counting
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        drafts = engine.stats()["spec_draft_tokens"]
    finally:
        engine.shutdown()
    got = [(o.token_ids, o.finish_reason, o.logprobs) for o in outs]
    return got, seen["most"], seen["placeholders"], drafts


@pytest.fixture(scope="module")
def synchronous() -> list[tuple]:
    return run(False)[0]


@pytest.mark.parametrize(
    "parallel",
    [
        {"pipeline_parallel_size": 2},
        {"pipeline_parallel_size": 3},
        {"tensor_parallel_size": 2},
        {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
    ],
    ids=lambda p: "x".join(f"{k[0].upper()}={v}" for k, v in p.items()),
)
def test_async_over_several_processes_equals_the_synchronous_engine(parallel, synchronous):
    got, most_in_flight, overlapped, _ = run(True, **parallel)
    assert_same(got, synchronous)
    stages = parallel.get("pipeline_parallel_size", 1)
    assert most_in_flight == stages + 1  # a batch per stage, and one launched behind them
    assert overlapped > 5  # steps really launched before the tokens they embed were back


def test_async_pipeline_with_speculative_decoding_equals_the_synchronous_engine(synchronous):
    """Greedy and seeded requests decode the same tokens with and without drafts."""
    spec = {"speculative_method": "ngram", "num_speculative_tokens": 2}
    got, most_in_flight, overlapped, drafts = run(True, pipeline_parallel_size=2, **spec)
    assert_same(got, synchronous)
    assert most_in_flight == 3 and overlapped > 0 and drafts > 0


def test_a_worker_killed_with_async_steps_in_flight_stops_the_engine():
    llm = LLM("tiny", async_scheduling=True, pipeline_parallel_size=2, **ENGINE)
    engine = llm.engine
    try:
        for prompt in PROMPTS:
            engine.add_request(prompt, SamplingParams(max_tokens=400, ignore_eos=True))
        for _ in range(4):
            engine.step()
        assert len(engine.in_flight) == 2
        worker = engine.executor.workers.procs[1]
        assert_killing_stops_the_engine(engine, worker.pid, r"stage 1, .*killed by SIGKILL")
        assert_stopped_for_good(llm, [worker])
    finally:
        engine.shutdown()
    assert not multiprocessing.active_children()


def test_structured_outputs_with_async_under_pipeline_parallelism_are_refused_by_name():
    from ostinato.sampling_params import StructuredOutputsParams

    with LLM("tiny", async_scheduling=True, pipeline_parallel_size=2, **ENGINE) as llm:
        constrained = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
            choice=["yes", "no"]))  # fmt: skip
        with pytest.raises(ValueError, match="--async-scheduling off"):
            llm.generate(["a"], constrained, use_tqdm=False)
        assert len(llm.generate(["a"], SamplingParams(max_tokens=2), use_tqdm=False)) == 1
