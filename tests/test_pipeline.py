"""Pipeline parallelism on CPU: spawned worker processes talking gloo, token-equal to one
process; faults become clear errors and leave no process behind; two torchrun "nodes"."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    assert_a_stopped_driver_leaves_nothing,
    assert_killing_stops_the_engine,
    assert_stopped_for_good,
    make_hf_checkpoint,
)
from oracle import oracle_prompts

import ostinato
from ostinato import LLM, SamplingParams
from ostinato.cli import build_parser, engine_config, main
from ostinato.config import EngineConfig
from ostinato.distributed.executor import WorkerError
from ostinato.distributed.parallel import Rank
from ostinato.engine.block_manager import BlockManager
from ostinato.engine.scheduler import Scheduler
from ostinato.engine.sequence import Sequence
from ostinato.loader import load_hf_config
from ostinato.models.base import IntermediateTensors
from ostinato.runner.model_runner import ModelRunner
from ostinato.runner.step import SamplingRow, dummy_step

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# small steps: long prompts are chunked, several batches share the pipeline
ENGINE = {"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 24, "max_num_seqs": 8}
TWO = {"pipeline_parallel_size": 2}
REPO = str(Path(ostinato.__file__).parents[1])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf_checkpoint("llama", tmp_path_factory.mktemp("llama"), num_hidden_layers=4)


@pytest.fixture(scope="module")
def prompts():
    return oracle_prompts(300)  # shared prefixes hit the prefix cache


def generate(llm: LLM, prompts, params=GREEDY) -> tuple[list[list[int]], int]:
    """Tokens per prompt (params: one for all, or one per prompt), and the most steps that
    were ever in flight at once."""
    engine = llm.engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    done, most_in_flight = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        most_in_flight = max(most_in_flight, len(engine.in_flight) + 1)
    return [done[i] for i in ids], most_in_flight


def workers_of(llm: LLM) -> list[multiprocessing.Process]:
    return list(llm.engine.executor.workers.procs.values())


@pytest.fixture(scope="module")
def reference(llama, prompts):
    return generate(LLM(str(llama), **ENGINE), prompts)[0]


def test_two_stages_equal_one_process_with_batches_in_flight(llama, prompts, reference):
    llm = LLM(str(llama), pipeline_parallel_size=2, **ENGINE)
    try:
        tokens, most_in_flight = generate(llm, prompts)
        assert tokens == reference
        assert most_in_flight == 2  # microbatches overlapped the stages
        report = llm.graph_report()
        assert [s["layers"] for s in report["stages"]] == [[0, 2], [2, 4]]
        assert report["stages"][0]["steps"] == report["stages"][1]["steps"]

        engine = llm.engine  # aborts and the prefix cache, with batches in flight
        hits_before = engine.block_manager.prefix_hits
        victim = engine.add_request(prompts[1], GREEDY)
        for _ in range(3):
            engine.step()
        engine.abort_request(victim)
        assert generate(llm, prompts)[0] == reference
        assert engine.block_manager.prefix_hits > hits_before
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        with pytest.raises(ValueError, match="one multi-process engine at a time"):
            LLM(str(llama), pipeline_parallel_size=2, **ENGINE)
    finally:
        llm.engine.shutdown()
    assert not any(p.is_alive() for p in workers_of(llm))


def test_three_stages_and_an_uneven_split(llama, prompts, reference):
    llm = LLM(str(llama), pipeline_parallel_size=3, pp_layer_partition=[2, 1, 1], **ENGINE)
    try:
        assert generate(llm, prompts)[0] == reference
        assert [s["layers"] for s in llm.graph_report()["stages"]] == [[0, 2], [2, 3], [3, 4]]
    finally:
        llm.engine.shutdown()
    assert not any(p.is_alive() for p in workers_of(llm))


@pytest.fixture(scope="module")
def tiny_reference(prompts):
    return generate(LLM("tiny", **ENGINE), prompts, TINY_PARAMS)[0]


TINY_PARAMS = [GREEDY] * 6 + [SamplingParams(temperature=1.0, seed=3, max_tokens=12)]


@pytest.mark.parametrize("stages", [2, 3])
def test_tiny_over_two_and_three_stages_equals_one_process(prompts, tiny_reference, stages):
    """Greedy (and one seeded sample), chunked prefill, up to `stages` batches in flight."""
    llm = LLM("tiny", pipeline_parallel_size=stages, **ENGINE)
    try:
        tokens, most_in_flight = generate(llm, prompts, TINY_PARAMS)
        assert tokens == tiny_reference
        assert most_in_flight == stages
        assert len({str(s["steps"]) for s in llm.graph_report()["stages"]}) == 1
    finally:
        llm.engine.shutdown()
    assert [p.exitcode for p in workers_of(llm)] == [0] * (stages - 1)  # left when asked


class Wire:
    """Two stages' links in one process: what the first sends, the second receives. Records
    where each receive wrote."""

    def __init__(self) -> None:
        self.sent: list[IntermediateTensors] = []
        self.received_into: list[tuple[int, int, tuple[int, ...]]] = []

    def send(self, out: IntermediateTensors) -> None:
        self.sent.append(IntermediateTensors(out.hidden_states.clone(), out.residual.clone()))

    def recv(self, into: IntermediateTensors) -> None:
        out = self.sent.pop(0)
        into.hidden_states.copy_(out.hidden_states)
        into.residual.copy_(out.residual)
        shape = tuple(into.hidden_states.shape)
        self.received_into.append((into.hidden_states.data_ptr(), into.residual.data_ptr(), shape))


def test_a_later_stage_receives_into_its_persistent_buffers_and_goes_on_from_them(prompts):
    """Two stages' runners in one process, wired together, against the whole model's runner
    on the same steps (chunked prefill, then decodes): hidden states and residual arrive in
    the buffers the later stage allocated once, at the step's size, and the tokens and
    logprobs are the whole model's."""
    hf_config = load_hf_config("tiny")
    config = EngineConfig(**ENGINE, **TWO).for_model(hf_config)
    wire = Wire()
    first = ModelRunner(config, hf_config, Rank(0, 1, 2), wire)
    last = ModelRunner(config, hf_config, Rank(1, 1, 2), wire)
    whole = ModelRunner(dataclasses.replace(config, pipeline_parallel_size=1), hf_config)
    for runner in (first, last, whole):
        runner.start(64)
    buffers = last.intermediate
    assert buffers.hidden_states.shape == (config.max_num_batched_tokens, hf_config.hidden_size)
    scheduler = Scheduler(whole.config, BlockManager(64, config.block_size))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3)
    for i, prompt in enumerate(prompts[:4]):
        scheduler.add(Sequence(f"r{i}", prompt, params))
    sizes = []
    while (batch := scheduler.schedule()) is not None:
        step = whole.build_step(batch)
        assert first.run(step) is None
        got, want = last.run(step), whole.run(step)
        if want is None:
            assert got is None
        else:
            assert got.token_ids == want.token_ids
            for a, b in zip(got.logprobs, want.logprobs, strict=True):
                assert [list(x) for x in a] == [list(x) for x in b]
                torch.testing.assert_close([list(x.values()) for x in a],
                                           [list(x.values()) for x in b])  # fmt: skip
            for row, tokens in zip(step.sampling, want.token_ids, strict=True):
                next(s for s in batch.seqs if s.request_id == row.request_id).token_ids += tokens
        scheduler.complete(batch)
        for seq in [s for s in batch.seqs if s.num_output_tokens >= 3]:
            scheduler.finish(seq, "length")
        sizes.append(step.padded_tokens)
    assert len(set(sizes)) > 2  # prefill chunks and decode batches of several sizes
    for hidden_ptr, residual_ptr, _ in wire.received_into:
        assert hidden_ptr == buffers.hidden_states.data_ptr()
        assert residual_ptr == buffers.residual.data_ptr()
    assert [shape[0] for *_, shape in wire.received_into] == sizes


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pipeline_parallel_size": 5}, "more than the model's 4 layers"),
        ({"pipeline_parallel_size": 2, "pp_layer_partition": [3, 2]}, "sum to the model's 4"),
        ({"pipeline_parallel_size": 2, "pp_layer_partition": [4]}, "one layer count per stage"),
        ({"pipeline_parallel_size": 2, "device": "cuda"}, "GPUs"),
    ],
)
def test_bad_settings_are_refused_before_any_process_starts(kwargs, message):
    before = len(multiprocessing.active_children())
    with pytest.raises(ValueError, match=message):
        LLM("tiny", **{"device": "cpu", **kwargs})
    assert len(multiprocessing.active_children()) == before


@pytest.mark.parametrize(
    ("layer", "error"),
    [
        (3, WorkerError),  # held by stage 1, a worker: its error, naming it
        (0, ValueError),  # held by stage 0, the driver: its own error, the workers stopped
    ],
)
def test_a_stage_that_fails_to_load_stops_every_rank_with_its_error(tmp_path, layer, error):
    broken = make_hf_checkpoint("llama", tmp_path / "broken", num_hidden_layers=4)
    from safetensors.torch import load_file, save_file

    weights = load_file(broken / "model.safetensors")
    del weights[f"model.layers.{layer}.mlp.down_proj.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    start = time.monotonic()
    stage = "stage 1.*" if layer == 3 else ""
    with pytest.raises(error, match=rf"{stage}lacks weights.*layers\.{layer}\.mlp\.down_proj"):
        LLM(str(broken), pipeline_parallel_size=2, **ENGINE)
    assert time.monotonic() - start < 60
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("victim", [1, 2])  # a middle stage; the last (it samples)
def test_a_worker_killed_mid_generation_stops_the_engine_naming_its_stage(llama, prompts, victim):
    llm = LLM(str(llama), pipeline_parallel_size=3, **ENGINE)
    engine = llm.engine
    try:
        for prompt in prompts:
            engine.add_request(prompt, GREEDY)
        for _ in range(4):
            engine.step()
        assert len(engine.in_flight) == 2  # batches on their way through the stages
        victim_pid = workers_of(llm)[victim - 1].pid
        assert_killing_stops_the_engine(engine, victim_pid, f"stage {victim}, .*killed by SIGKILL")
        assert_stopped_for_good(llm, workers_of(llm))
    finally:
        engine.shutdown()


def test_a_worker_that_dies_between_steps_stops_the_engine_before_the_next():
    llm = LLM("tiny", **ENGINE, **TWO)
    try:
        os.kill(workers_of(llm)[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while llm.engine.failed is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "stage 1, tensor rank 0 (rank 1) was killed by SIGKILL" in llm.engine.failed
        with pytest.raises(WorkerError, match="stage 1, .*killed by SIGKILL"):
            llm.generate(["again"], GREEDY, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def test_a_stuck_worker_stops_the_engine_after_the_timeout_instead_of_hanging_it():
    """A worker that neither answers nor dies (stopped with SIGSTOP): the driver's wait for
    its message (a report here; a step's tokens take the same way) ends after
    distributed_timeout with an error naming it, and it is killed."""
    llm = LLM("tiny", **ENGINE, **TWO, distributed_timeout=10)
    try:
        assert len(llm.generate(["Hello"], GREEDY, use_tqdm=False)[0].token_ids) == 10
        worker = workers_of(llm)[0]
        os.kill(worker.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"stage 1, .* stopped answering for distributed_ti"):
            llm.graph_report()
        assert 10 <= time.monotonic() - start < 30
        worker.join(5)
        assert worker.exitcode == -signal.SIGKILL
    finally:
        llm.engine.shutdown()


def test_a_worker_that_raises_mid_step_stops_the_engine_with_its_error():
    llm = LLM("tiny", **ENGINE, **TWO)
    engine, config = llm.engine, llm.engine.config
    step = dummy_step(4, 1, config.max_model_len, config.block_size)
    step.logits_indices = np.array([100])  # past the step's 4 rows: only the last stage reads it
    step.sampling = [SamplingRow("bad", GREEDY, 4)]
    try:
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"stage 1, tensor rank 0 \(rank 1\) failed: Index"):
            engine.executor.submit(step).result()
        assert time.monotonic() - start < 30
        assert_stopped_for_good(llm, workers_of(llm))
    finally:
        engine.shutdown()


def test_an_engine_built_in_a_thread_keeps_its_workers_after_the_thread_ends():
    """Linux kills a worker when the thread that started it ends (PR_SET_PDEATHSIG): the
    engine's own watchdog thread starts them, not the caller's."""
    built: list[LLM] = []
    builder = threading.Thread(target=lambda: built.append(LLM("tiny", **ENGINE, **TWO)))
    builder.start()
    builder.join()
    llm = built[0]
    try:
        time.sleep(0.5)
        assert all(p.is_alive() for p in workers_of(llm))
        assert len(llm.generate(["Hello"], GREEDY, use_tqdm=False)[0].token_ids) == 10
    finally:
        llm.engine.shutdown()


def test_shutdown_with_a_step_in_flight_is_prompt_and_the_workers_leave_by_themselves():
    llm = LLM("tiny", **ENGINE, **TWO)
    engine = llm.engine
    try:
        for i in range(4):
            engine.add_request(f"request {i} " * 5, GREEDY)
        engine.step()  # submits two batches, finishes one
        assert len(engine.in_flight) == 1
    finally:
        start = time.monotonic()
        engine.shutdown()
    assert time.monotonic() - start < 5
    assert [p.exitcode for p in workers_of(llm)] == [0]


DRIVER = """
import sys
from ostinato import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM("tiny", device="cpu", pipeline_parallel_size=2, max_num_batched_tokens=16)
    engine = llm.engine
    for i in range(6):
        engine.add_request(f"prompt {i} " * 8, SamplingParams(max_tokens=4000, ignore_eos=True))
    engine.step()
    print("stepping", flush=True)
    while engine.has_unfinished_requests():
        engine.step()
"""


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: signal.Signals(s).name
)
def test_a_driver_stopped_mid_generation_leaves_no_process_behind(tmp_path, sig):
    """Ctrl-C, a polite kill, a hard kill: the driver ends within seconds, and every process
    it started (the worker, multiprocessing's resource tracker) ends with it."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    assert_a_stopped_driver_leaves_nothing(script, sig, "stepping", start_s=120, children=2)


# ---- the command line ----------------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "serve", "explain", "bench latency"])
def test_every_command_takes_the_parallel_flags(command):
    flags = ["--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"]
    args = build_parser().parse_args([*command.split(), *flags, "--pp-layer-partition", "3,1"])
    config = engine_config(args)
    assert (config.pipeline_parallel_size, config.tensor_parallel_size) == (2, 2)
    assert config.pp_layer_partition == [3, 1]


def test_explain_prints_each_stage_and_each_tensor_rank_share(capsys):
    argv = ["explain", "--model", "tiny", "--device", "cpu", "--pipeline-parallel-size", "2"]
    argv += ["--tensor-parallel-size", "2", "--pp-layer-partition", "3,1"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("stage ")] == [
        "stage ranks=[0, 1], layers=[0, 3], embedding=True, lm_head_and_sampler=False",
        "stage ranks=[2, 3], layers=[3, 4], embedding=False, lm_head_and_sampler=True",
    ]
    assert any(line.startswith("tensor_parallel: {'size': 2,") for line in out)
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["layers"] for s in report["stages"]] == [[0, 3], [3, 4]]
    assert main([*argv[:-1], "3,2"]) == 2  # refused before anything starts, with the fix
    assert "sum to the model's 4 layers" in capsys.readouterr().err


def test_bench_runs_pipelined_engines_one_after_another(capsys):
    argv = ["bench", "latency", "--device", "cpu", "--json", "--batch-size", "2"]
    argv += ["--input-len", "16", "--output-len", "3", "--iters", "1"]
    argv += ["--pipeline-parallel-size", "2", "--cuda-graph-mode", "none,piecewise"]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["pp"], r["tp"], r["requested_mode"]) for r in lines] == [
        (2, 1, "none"),
        (2, 1, "piecewise"),
    ]
    assert all(r["tpot_ms"] > 0 for r in lines)
    assert not multiprocessing.active_children()  # each engine's worker stopped with it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(node_rank: int, port: int, model: str, *flags: str) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
        str(node_rank), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
        "--master-port", str(port), "-m", "ostinato.cli", "generate", "--model", model,
        "--dtype", "float32", "--max-tokens", "8", "--ignore-eos", "--pipeline-parallel-size",
        "2", *flags, "The quick brown fox",
    ]  # fmt: skip
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group: the rank it starts goes with it
    )  # fmt: skip


def _finish(nodes: list[subprocess.Popen], timeout: float = 180) -> list[tuple[str, str]]:
    """Each node's (stdout, stderr); a node still running after timeout fails the test, and
    no node outlives it, with the rank torchrun started."""
    try:
        return [node.communicate(timeout=timeout) for node in nodes]
    finally:
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait()


def test_two_torchrun_nodes_generate_what_one_process_does(llama):
    port = _free_port()
    nodes = [_torchrun(rank, port, str(llama)) for rank in (0, 1)]
    outs = _finish(nodes)
    assert [node.returncode for node in nodes] == [0, 0], outs
    single = subprocess.run(
        [sys.executable, "-m", "ostinato.cli", "generate", "--model", str(llama), "--dtype",
         "float32", "--max-tokens", "8", "--ignore-eos", "The quick brown fox"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "(8 tokens, length)" in single.stdout
    assert outs[0][0] == single.stdout  # rank 0 prints; the other node only serves


def test_torchrun_nodes_with_different_settings_fail_clearly(llama):
    port = _free_port()
    nodes = [
        _torchrun(0, port, str(llama), "--max-num-seqs", "8"),
        _torchrun(1, port, str(llama), "--max-num-seqs", "16"),
    ]
    outs = _finish(nodes)
    assert all(node.returncode != 0 for node in nodes)
    assert "start every rank with the same engine flags" in outs[0][1]
    assert "max_num_seqs: 16 vs 8" in outs[0][1] + outs[1][1]
