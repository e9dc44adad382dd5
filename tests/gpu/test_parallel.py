"""On two GPUs with NCCL: pipeline stages and tensor ranks (all-reduces captured inside the
graphs) in every mode equal one GPU; faults."""

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
from helpers import (
    assert_a_stopped_driver_leaves_nothing,
    is_alive,
    make_hf_checkpoint,
    overlapped_submits,
    shut_down_killing,
)
from oracle import MODES, engine, mixed_workload

from ostinato import SamplingParams
from ostinato.distributed import launcher, worker
from ostinato.distributed.executor import WorkerError
from ostinato.runner import model_runner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint("llama", tmp_path_factory.mktemp("llama"), num_hidden_layers=4)


@pytest.fixture(scope="module")
def reference(checkpoint):
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = engine(checkpoint, "none")
    tokens = mixed_workload(llm)
    del llm
    return tokens


def check_steps(mode: str, steps: dict) -> None:
    if mode in ("piecewise", "full_and_piecewise"):
        assert steps["piecewise"] > 0, steps
    if mode in ("full", "full_decode_only", "full_and_piecewise"):
        assert steps["full"] > 0, steps


@pytest.mark.parametrize("mode", MODES)
def test_two_stages_equal_one_gpu_with_the_checker_on(checkpoint, reference, mode):
    llm = engine(checkpoint, mode, pipeline_parallel_size=2, check_graphs=1)
    try:
        assert mixed_workload(llm) == reference
        stages = llm.graph_report()["stages"]
        assert [s["layers"] for s in stages] == [[0, 2], [2, 4]]
        for stage in stages:
            check_steps(mode, stage["steps"])
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("mode", MODES)
def test_two_tensor_ranks_equal_one_gpu_with_the_checker_on(checkpoint, reference, mode):
    llm = engine(checkpoint, mode, tensor_parallel_size=2, check_graphs=1)
    try:
        assert mixed_workload(llm) == reference
        stages = llm.graph_report()["stages"]
        assert [(s["tp_rank"], s["layers"]) for s in stages] == [(0, [0, 4]), (1, [0, 4])]
        for stage in stages:
            check_steps(mode, stage["steps"])
        for key in ("steps", "warmups", "dropped", "captured"):  # the ranks agreed (check 1)
            assert stages[0][key] == stages[1][key], key
    finally:
        llm.engine.shutdown()


def test_two_tensor_ranks_with_lazy_capture(checkpoint, reference):
    """Each graph captured at its first use, on both ranks at the same step (a cold kernel
    makes both run that step eagerly, collectives included)."""
    llm = engine(
        checkpoint, "full_and_piecewise", tensor_parallel_size=2, cuda_graph_capture="lazy"
    )
    try:
        assert mixed_workload(llm) == reference
        stages = llm.graph_report()["stages"]
        for key in ("steps", "warmups", "dropped", "captured"):
            assert stages[0][key] == stages[1][key], key
        check_steps("full_and_piecewise", stages[0]["steps"])
    finally:
        llm.engine.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs")
def test_two_tensor_ranks_times_two_stages_equal_one_gpu(checkpoint, reference):
    llm = engine(
        checkpoint,
        "full_and_piecewise",
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        check_graphs=1,
    )
    try:
        assert mixed_workload(llm) == reference
        stages = llm.graph_report()["stages"]
        assert [(s["pp_rank"], s["tp_rank"]) for s in stages] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        for stage in stages:
            check_steps("full_and_piecewise", stage["steps"])
    finally:
        llm.engine.shutdown()


LAYOUTS = {
    "P=2": {"pipeline_parallel_size": 2},
    "T=2": {"tensor_parallel_size": 2},
    "T=2xP=2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
}


@pytest.mark.parametrize("mode", ["none", "full_and_piecewise"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_async_scheduling_over_several_gpus_equals_one_gpu(checkpoint, reference, layout, mode):
    """Async scheduling over NCCL (README check 5): the sampling rank's tokens reach the first
    stage within the step, the driver launches the next step behind the ones in flight (a
    batch per stage and one more), and the tokens are one GPU's, graph checker on."""
    parallel = LAYOUTS[layout]
    stages = parallel.get("pipeline_parallel_size", 1)
    if stages * parallel.get("tensor_parallel_size", 1) > torch.cuda.device_count():
        pytest.skip(f"{layout} needs more GPUs")
    llm = engine(checkpoint, mode, async_scheduling=True, check_graphs=1, **parallel)
    try:
        assert llm.engine.executor.max_in_flight == stages + 1
        submits = overlapped_submits(llm)
        assert mixed_workload(llm) == reference
        assert max(submits) == stages, submits  # a batch per stage, and one launched behind
        assert submits.count(stages) > len(submits) // 2, submits
        check_steps(mode, llm.graph_report()["stages"][0]["steps"])
    finally:
        llm.engine.shutdown()


def test_a_killed_stage_stops_the_engine_within_seconds(checkpoint):
    llm = engine(checkpoint, "full_and_piecewise", pipeline_parallel_size=2)
    mixed_workload(llm)
    worker = next(iter(llm.engine.executor.workers.procs.values()))
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="stage 1.*killed by SIGKILL"):
        mixed_workload(llm)
    assert time.monotonic() - start < 30
    assert not worker.is_alive()


DRIVER = """
from ostinato import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM("random:qwen3-0.6b", tensor_parallel_size=2, cuda_graph_mode="full_and_piecewise",
              max_model_len=4096, gpu_memory_utilization=0.3)
    engine = llm.engine
    for i in range(8):
        engine.add_request([100 + i] * 16, SamplingParams(max_tokens=3000, ignore_eos=True))
    while engine.runner.graph_report()["steps"]["full"] < 20:
        engine.step()
    print("replaying", flush=True)
    while engine.has_unfinished_requests():
        engine.step()
"""


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: signal.Signals(s).name
)
def test_a_driver_stopped_mid_replays_leaves_no_process_behind(tmp_path, sig):
    """Ctrl-C, a polite kill, a hard kill of a T=2 driver while it replays FULL graphs (their
    all-reduces inside them, its worker in the same replays): the driver ends within seconds,
    without a hang in destroy_process_group or ncclCommAbort, and its worker with it."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    assert_a_stopped_driver_leaves_nothing(script, sig, "replaying", start_s=300, stop_s=30)


# SIGKILL: the watchdog sees the death (under the default distributed_timeout of 120 s);
# SIGSTOP: the rank is alive and its connections open, so NCCL sees no error, and only the
# host's deadline on the step (distributed_timeout=10 here) and the stopped heartbeat tell
LOST = {
    "SIGKILL": (signal.SIGKILL, "was killed by SIGKILL", {}, 30),
    "SIGSTOP": (signal.SIGSTOP, "stopped answering", {"distributed_timeout": 10}, 10 + 15),
}


@pytest.mark.parametrize("how", LOST)
def test_a_tensor_rank_lost_during_graph_replays_stops_the_engine_within_seconds(checkpoint, how):
    """The all-reduces are inside the FULL graphs: a peer that dies or stops mid-replay leaves
    rank 0's stream waiting on NCCL. The engine must still stop with the rank's name within
    seconds (of the death, or of the deadline), and leave no worker."""
    sig, error, options, within = LOST[how]
    llm = engine(checkpoint, "full_and_piecewise", tensor_parallel_size=2, **options)
    worker = llm.engine.executor.workers.procs[1]
    lost_at: list[float] = []

    def lose_once_decoding() -> None:
        deadline = time.monotonic() + 120
        while llm.engine.generation_tokens_total < 64 and time.monotonic() < deadline:
            time.sleep(0.01)
        lost_at.append(time.monotonic())
        os.kill(worker.pid, sig)

    killer = threading.Thread(target=lose_once_decoding, daemon=True)
    params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    try:
        killer.start()
        with pytest.raises(WorkerError, match=rf"stage 0, tensor rank 1 \(rank 1\) {error}"):
            llm.generate([[5, 6, 7]] * 8, params, use_tqdm=False)
        assert time.monotonic() - lost_at[0] < within
        assert llm.engine.runner.graph_report()["steps"]["full"] > 0  # rank 0's own replays
    finally:
        killer.join(5)
        llm.engine.shutdown()
        left = worker.is_alive()
        if left:  # never leave a stopped process behind the test
            os.kill(worker.pid, signal.SIGKILL)
    assert not left


def test_a_tensor_rank_killed_during_shutdown_leaves_nothing(checkpoint, reference):
    """README check 3, second half: after FULL replays (NCCL's communicators captured in the
    graphs), rank 1 is killed while shutdown() waits for the workers to take their Shutdown
    message. shutdown returns within seconds, without a hang in destroy_process_group or
    ncclCommAbort, the engine names the rank, and no process is left."""
    llm = engine(checkpoint, "full_and_piecewise", tensor_parallel_size=2)
    core = llm.engine
    assert mixed_workload(llm) == reference
    assert core.runner.graph_report()["steps"]["full"] > 0
    seconds, victim = shut_down_killing(core, 1)
    assert seconds < 30
    assert "stage 0, tensor rank 1 (rank 1) was killed by SIGKILL" in core.failed
    assert not is_alive(victim) and not multiprocessing.active_children()


LATE_S = 10  # rank 1 loads its weights this much later than rank 0


def late_loading_worker(rank, config, meet, parent) -> None:
    """A spawned worker that, on rank 1, loads its weights LATE_S seconds late."""
    if rank == 1:
        load = model_runner.load_model

        def late_load(*args, **kwargs):
            time.sleep(LATE_S)
            return load(*args, **kwargs)

        model_runner.load_model = late_load
    worker.worker_main(rank, config, meet, parent)


def test_a_rank_that_loads_later_than_the_deadline_still_starts(checkpoint, reference, monkeypatch):
    """README check 4 on NCCL: rank 1 loads 10 s late, more than twice distributed_timeout
    (4 s). Its first collectives (the start-up barrier, then the KV sizing's step) wait under
    the start-up wait, so the engine starts and gives one GPU's tokens."""
    monkeypatch.setattr(launcher, "worker_main", late_loading_worker)
    start = time.monotonic()
    llm = engine(checkpoint, "full_and_piecewise", tensor_parallel_size=2, distributed_timeout=4)
    try:
        assert time.monotonic() - start > LATE_S  # rank 1 was late, and was waited for
        assert mixed_workload(llm) == reference
    finally:
        llm.engine.shutdown()
