"""Distributed paths made safe before they meet two GPUs (issue 23), on the CPU with gloo.

CUDA graphs need a GPU, so the engines here capture with a stand-in: a "graph" that runs its
forward again at each replay, with collectives skipped while it is captured (a CUDA capture
records NCCL collectives and communicates nothing) and a Triton kernel (interpreted) at the
start of every forward, so the kernel-variant bookkeeping of kernels/variants.py decides the
warm-ups as it does on a GPU. Spawned workers install the same stand-in (launcher.worker_main
is swapped for `faked_worker` below). A wrapper counts every collective a rank runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import signal
import threading
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import triton.language as tl
from helpers import assert_stopped_for_good, is_alive, shut_down_killing

from ostinato import LLM, SamplingParams
from ostinato.distributed import launcher, worker, world
from ostinato.distributed.executor import WorkerError
from ostinato.distributed.parallel import startup_timeout
from ostinato.engine.engine import EngineShutdownError
from ostinato.graphs import capture, compat
from ostinato.kernels import variants
from ostinato.kernels.dispatch import jit
from ostinato.runner import deadline, model_runner
from ostinato.runner.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
ENGINE = {
    "device": "cpu",
    "dtype": "float32",
    "max_num_seqs": 4,
    "max_num_batched_tokens": 16,
    "capture_sizes": [1, 2, 16],  # a kernel variant each: n == 1, n % 16 == 0, neither
}
PROMPTS = ["Hello there", "The quick brown fox jumps", "0123456789 abcdef", "once upon"]
LOG_DIR = "OSTINATO_TEST_COLLECTIVES"  # where each worker writes its collectives
INJECT = "OSTINATO_TEST_FAULT"  # on rank 1: "<capture|warmup>:<num_tokens>", out of memory;
# "load:<seconds>", its weights loaded that much later


# ---- the stand-in for CUDA graphs, and the collective counter ------------------------------
@jit
def _touch_kernel(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


class Fakes:
    def __init__(self, rank: int, inject: str = "") -> None:
        self.rank = rank
        self.capturing = False
        self.log: list[str] = []  # the collectives this rank ran, in order
        # NCCL's destroy waits for every graph that captured a collective: count them
        self.graphs_alive = 0
        self.graphs_at_destroy: list[int] = []
        where, _, size = inject.partition(":")
        self.inject = (where, int(size)) if inject and rank == 1 else None

    def patches(self) -> list[tuple[object, str, object]]:
        fakes = self
        all_reduce, all_gather = dist.all_reduce, dist.all_gather
        destroy = dist.destroy_process_group

        def counted_destroy(*args, **kwargs):
            fakes.graphs_at_destroy.append(fakes.graphs_alive)
            return destroy(*args, **kwargs)

        def counted(op, real):
            def collective(tensor, *args, **kwargs):
                what = f"{op} {tuple(getattr(tensor, 'shape', ()))}"
                if fakes.capturing:  # recorded into the graph: nothing is exchanged
                    return None
                fakes.log.append(what)
                return real(tensor, *args, **kwargs)

            return collective

        class Graph:
            """Replay runs the captured forward again, under the live forward context (as a
            PIECEWISE graph's attention breaks read it)."""

            def __init__(self, pool, stream) -> None:
                self.output = self.forward = None

            def capture(self, fn, breaks: bool = True):
                fakes.capturing = True
                try:
                    self.output = fn()
                finally:
                    fakes.capturing = False
                self.forward = fakes.last_forward
                fakes.graphs_alive += 1
                return self.output

            def __del__(self):
                fakes.graphs_alive -= self.forward is not None

            def replay(self):
                return self.forward()

        forward, load = ModelRunner._model_forward, model_runner.load_model

        def late_load(*args, **kwargs):
            if fakes.inject and fakes.inject[0] == "load":
                time.sleep(fakes.inject[1])
            return load(*args, **kwargs)

        def model_forward(runner, num_tokens: int):
            fakes.last_forward = lambda: forward(runner, num_tokens)
            if fakes.inject == ("capture", num_tokens) and fakes.capturing:
                raise torch.cuda.OutOfMemoryError("injected (capture)")
            if fakes.inject == ("warmup", num_tokens) and variants.mode == variants.RECORD:
                raise torch.cuda.OutOfMemoryError("injected (warm-up)")
            os.environ["TRITON_INTERPRET"] = "1"
            try:  # a kernel whose variant follows num_tokens, as the model's kernels do
                _touch_kernel[(1,)](torch.zeros(num_tokens), num_tokens, BLOCK=16)
            finally:
                del os.environ["TRITON_INTERPRET"]
            return forward(runner, num_tokens)

        return [
            (dist, "all_reduce", counted("all_reduce", all_reduce)),
            (dist, "all_gather", counted("all_gather", all_gather)),
            (dist, "destroy_process_group", counted_destroy),
            (compat, "RULES", tuple(r for r in compat.RULES if r.name != "cpu_device")),
            (capture, "BreakableGraph", Graph),
            (ModelRunner, "_model_forward", model_forward),
            (model_runner, "load_model", late_load),
            (torch.cuda, "synchronize", lambda *a: None),
            (torch.cuda, "empty_cache", lambda: None),
            (torch.cuda, "mem_get_info", lambda *a: (2**30, 2**31)),
            (torch.cuda, "Stream", _Stream),
            (torch.cuda, "current_stream", _Stream),
            (torch.cuda, "stream", lambda s: contextlib.nullcontext()),
            (torch.cuda, "graph_pool_handle", lambda: (0, 0)),
        ]


class _Stream:
    def wait_stream(self, other) -> None:
        pass


def faked_worker(rank, config, meet, parent) -> None:
    """A spawned worker with the stand-in installed; it writes its collectives on leaving."""
    fakes = Fakes(rank, os.environ.get(INJECT, ""))
    for owner, name, value in fakes.patches():
        setattr(owner, name, value)
    worker.worker_main(rank, config, meet, parent)
    logs = Path(os.environ[LOG_DIR])
    (logs / f"rank{rank}-{os.getpid()}.json").write_text(json.dumps(fakes.log))
    (logs / f"destroy{rank}-{os.getpid()}.json").write_text(json.dumps(fakes.graphs_at_destroy))


@pytest.fixture
def faked(monkeypatch, tmp_path):
    """The driver (rank 0) and its spawned workers capture with the stand-in; returns the
    driver's Fakes."""
    fakes = Fakes(0)
    for owner, name, value in fakes.patches():
        monkeypatch.setattr(owner, name, value)
    monkeypatch.setattr(launcher, "worker_main", faked_worker)
    monkeypatch.setenv(LOG_DIR, str(tmp_path))
    monkeypatch.setattr(variants, "_launched", set())  # this test's first engine starts cold
    return fakes


def worker_log(tmp_path: Path, pid: int) -> list[str]:
    return json.loads(next(tmp_path.glob(f"rank1-{pid}.json")).read_text())


def generate(llm: LLM) -> list[list[int]]:
    params = [GREEDY] * (len(PROMPTS) - 1) + [SEEDED]
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM("tiny", **ENGINE)
    return generate(llm)


# ---- 1. agreed warm-ups -----------------------------------------------------------------------
def test_two_tensor_parallel_engines_in_one_process_issue_the_same_collectives(
    faked, tmp_path, reference
):
    """The second engine's driver has every kernel variant warm (the first engine launched
    them) while its new worker starts cold: the ranks still warm up together, so each runs
    the same collectives in the same order, and the tokens are one process's."""
    for engine in range(2):
        faked.log.clear()
        llm = LLM("tiny", tensor_parallel_size=2, distributed_timeout=20, **ENGINE)
        try:
            if engine == 1:  # the first only warms the driver's kernel variants up
                assert generate(llm) == reference
            report = llm.graph_report()
            pid = llm.engine.executor.workers.procs[1].pid
        finally:
            llm.engine.shutdown()
        stages = report["stages"]
        assert report["cuda_graph_mode"] == "piecewise" and len(report["captured"]["piecewise"])
        assert [s["warmups"] for s in stages] == [3, 3], f"engine {engine}"
        assert stages[0]["steps"] == stages[1]["steps"]
        assert stages[0]["steps"]["piecewise"] or engine == 0
        mine = faked.log[: len(worker_log(tmp_path, pid))]  # less its report's gathers
        assert mine == worker_log(tmp_path, pid) and len(mine) > 20, f"engine {engine}"
        # each rank dropped its graphs before destroying its groups (else NCCL waits forever)
        worker_destroys = json.loads((tmp_path / f"destroy1-{pid}.json").read_text())
        assert faked.graphs_at_destroy[-1:] == worker_destroys == [0], f"engine {engine}"


def test_a_rank_that_loads_later_than_the_deadline_still_starts(faked, monkeypatch, reference):
    """README check 4: rank 1 loads its weights 7 s after rank 0, more than twice
    distributed_timeout. The stage waits for it at the start-up barrier under the start-up
    wait, and the engine gives one process's tokens. (Without the barrier a CPU engine
    starts too: its first collective after loading is the warm-up agreement, also under the
    start-up wait; on a GPU it is the KV sizing's step, under the step's deadline.)"""
    monkeypatch.setenv(INJECT, "load:7")
    llm = LLM("tiny", tensor_parallel_size=2, distributed_timeout=3, **ENGINE)
    try:
        assert generate(llm) == reference
    finally:
        llm.engine.shutdown()


def test_out_of_memory_in_one_ranks_capture_drops_the_size_on_every_rank(
    faked, tmp_path, monkeypatch, reference
):
    monkeypatch.setenv(INJECT, "capture:16")
    llm = LLM("tiny", tensor_parallel_size=2, distributed_timeout=20, **ENGINE)
    try:
        assert generate(llm) == reference
        report = llm.graph_report()
        pid = llm.engine.executor.workers.procs[1].pid
    finally:
        llm.engine.shutdown()
    dropped = [{"num_tokens": 16, "num_reqs": None, "uniform_query_len": None,
                "num_active_loras": 0}]  # fmt: skip
    assert [s["dropped"] for s in report["stages"]] == [dropped, dropped]
    assert report["stages"][0]["captured"] == report["stages"][1]["captured"]
    assert faked.log[: len(worker_log(tmp_path, pid))] == worker_log(tmp_path, pid)


def test_out_of_memory_in_one_ranks_warm_up_stops_the_engine_cleanly(faked, monkeypatch):
    """The warm-up has run collectives its peer waits on: it cannot be skipped, so the
    engine stops at once with the rank's error, and no process is left."""
    monkeypatch.setenv(INJECT, "warmup:16")  # the largest: its warm-up comes first
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"tensor rank 1 \(rank 1\) failed: .*out of memory in"):
        LLM("tiny", tensor_parallel_size=2, distributed_timeout=20, **ENGINE)
    assert time.monotonic() - start < 30
    assert not multiprocessing.active_children()


# ---- 2. faults become WorkerError -------------------------------------------------------------
def test_a_host_wait_on_the_device_ends_at_its_deadline():
    class Stuck:
        def query(self) -> bool:
            return False

    start = time.monotonic()
    with pytest.raises(deadline.DeviceTimeout, match="sampled tokens within distributed_time"):
        deadline.wait_for(Stuck(), 0.2, "the step's sampled tokens")
    assert 0.2 <= time.monotonic() - start < 2
    done = iter([False, False, True])

    class Finishing:
        def query(self) -> bool:
            return next(done)

    deadline.wait_for(Finishing(), 5, "anything")


def test_a_host_wait_spins_then_backs_off_and_names_what_it_waited_for(monkeypatch):
    """On a clock of its own (each query takes half a millisecond): no sleep for the first
    _SPIN_S, then sleeps doubling from 10 µs up to 1 ms; past the timeout, one error naming
    what was awaited, the timeout and the cause. Without a timeout: a plain synchronize."""
    now, sleeps = [0.0], []

    def sleep(seconds: float) -> None:
        sleeps.append((now[0], seconds))
        now[0] += seconds

    monkeypatch.setattr(
        deadline, "time", types.SimpleNamespace(monotonic=lambda: now[0], sleep=sleep)
    )

    class Stuck:
        synchronized = False

        def query(self) -> bool:
            now[0] += 5e-4
            return False

        def synchronize(self) -> None:
            self.synchronized = True

    with pytest.raises(deadline.DeviceTimeout) as error:
        deadline.wait_for(Stuck(), 0.05, "the step's sampled tokens")
    assert str(error.value) == (
        "the device did not finish the step's sampled tokens within distributed_timeout=0.05 s: "
        "a collective or transfer of the step waits on a rank that is stuck or gone"
    )
    assert sleeps[0][0] > deadline._SPIN_S and now[0] > 0.05
    doubling = [1e-5 * 2**i for i in range(7)] + [1e-3] * (len(sleeps) - 7)
    assert [s for _, s in sleeps] == pytest.approx(doubling) and len(sleeps) > 9
    event, before = Stuck(), now[0]
    deadline.wait_for(event, None, "anything")
    assert event.synchronized and now[0] == before  # neither a query nor a sleep


class _Event:
    """A CUDA event the device reaches (done) or never does (a replay waiting on a peer)."""

    done = False

    def record(self, stream) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        raise AssertionError("a host wait on the device without a deadline")


@pytest.mark.parametrize("done", [False, True], ids=["stuck", "drained"])
def test_closing_a_runner_waits_on_the_device_only_until_the_deadline(monkeypatch, done):
    """Shutdown after a rank stopped answering: the driver's stream may still wait on it in a
    replayed all-reduce, for good. close() waits for that stream under the steps' deadline; past
    it, the memory stays to the process's exit (freeing would wait on the device too) instead
    of hanging the shutdown. A drained device gives its memory back."""
    from ostinato.config import EngineConfig
    from ostinato.loader import load_hf_config
    from ostinato.runner import model_runner

    hf_config = load_hf_config("tiny")
    config = EngineConfig(model="tiny", **ENGINE).for_model(hf_config)
    runner = ModelRunner(config, hf_config)
    runner.start(16)
    runner.device_timeout = 0.2  # as with several processes
    freed: list[bool] = []
    monkeypatch.setattr(EngineConfig, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "Event", type("Event", (_Event,), {"done": done}))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: _Event().synchronize())
    monkeypatch.setattr(model_runner, "release_memory", lambda: freed.append(True))
    start = time.monotonic()
    runner.close()
    waited = time.monotonic() - start
    assert runner.model is None and runner.kv_caches == []
    assert freed == [True] * done  # memory given back only by a drained device
    assert (0.2 <= waited < 2) if not done else waited < 0.2


def test_every_rank_leaves_nccl_faults_to_the_engine_unless_told_otherwise(monkeypatch):
    """PyTorch's NCCL watchdog neither aborts a communicator nor kills the process (its
    heartbeat monitor would, eight minutes after a timeout it saw). A setting the user made
    stays."""
    for name in world.NCCL_FAULT_SETTINGS:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)  # unset, and set back as it was after the test
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    with LLM("tiny", tensor_parallel_size=2, distributed_timeout=20, **ENGINE):
        pass
    assert os.environ["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


@pytest.mark.parametrize("is_cuda", [True, False])
def test_pytorchs_nccl_watchdog_times_out_after_the_engines_deadline(is_cuda):
    """Over NCCL a group's timeout only feeds PyTorch's watchdog, whose timeout starts a
    dump and an eight-minute sleep that shutdown waits for: it comes after the engine's
    deadline, even at start-up's. gloo's timeout is the host's deadline itself."""
    config = types.SimpleNamespace(is_cuda=is_cuda, distributed_timeout=130.0)
    seconds = world.watchdog_timeout(config).total_seconds()
    assert seconds >= startup_timeout(130.0) > 130.0 if is_cuda else seconds == 130.0


def test_a_rank_that_stops_answering_mid_step_is_named_within_the_deadline():
    llm = LLM("tiny", tensor_parallel_size=2, distributed_timeout=5, **ENGINE)
    engine = llm.engine
    worker_proc = engine.executor.workers.procs[1]
    try:
        for prompt in PROMPTS:
            engine.add_request(prompt, SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step()
        os.kill(worker_proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"stage 0, tensor rank 1 \(rank 1\) stopped answ"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 5 + 10
        assert_stopped_for_good(llm, [worker_proc])
    finally:
        engine.shutdown()
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker_proc.pid, signal.SIGKILL)


def test_settling_polls_the_workers_only_while_it_holds_the_reaping_lock():
    """settle() asks whether workers live (a poll that reaps an exited one) only under
    _reaping, as the watchdog's _describe joins: unlocked, it could collect a killed worker's
    status first and leave the watchdog naming it "exited (exit status unknown)" instead of
    "killed by SIGKILL" (seen once in a full CI run)."""
    workers = launcher.Workers.__new__(launcher.Workers)
    workers._reaping, workers.cause = threading.RLock(), None
    owned = []

    class Dying:  # a worker going down: never seen alive, its cause not yet named
        def is_alive(self):
            owned.append(workers._reaping._is_owned())
            if len(owned) == 3:
                workers.cause = "pipeline stage 1, tensor rank 0 (rank 1) was killed by SIGKILL"
            return False

    workers.procs = {1: Dying()}
    assert workers.settle(patience=5.0) == workers.cause
    assert owned == [True, True, True]


def test_a_rank_killed_during_teardown_is_named_and_nothing_is_left():
    """The kill lands while shutdown waits for the workers to take their Shutdown message:
    the watchdog's abort and the driver's leave meet, once each; shutdown returns within
    seconds, the engine names the rank, and no process is left."""
    llm = LLM("tiny", pipeline_parallel_size=2, **ENGINE)
    engine = llm.engine
    assert len(generate(llm)) == len(PROMPTS)
    seconds, victim = shut_down_killing(engine, 1)
    assert seconds < 15
    assert "stage 1, tensor rank 0 (rank 1) was killed by SIGKILL" in engine.failed
    assert not is_alive(victim) and not multiprocessing.active_children()
    with pytest.raises(EngineShutdownError):  # shut down, as asked; engine.failed says why
        llm.generate(["again"], GREEDY, use_tqdm=False)


# ---- 3. one abort ---------------------------------------------------------------------------
def test_teardown_has_one_owner_abort_and_leave_never_overlap_and_run_once(monkeypatch):
    """The watchdog thread aborts while the main thread leaves: the second waits for the
    first, an abort after leaving does nothing, and each runs at most once."""
    from ostinato.distributed import world

    events, busy = [], [False]

    def slow(name):
        def run(*args):
            assert not busy[0], f"{name} overlapped another teardown"
            busy[0] = True
            events.append(name)
            time.sleep(0.2)
            busy[0] = False

        return run

    monkeypatch.setattr(world, "_abort_all", slow("abort"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", slow("destroy"))
    monkeypatch.setattr(world, "_teardown", world._Teardown())
    watchdog = threading.Thread(target=lambda: [world.teardown(abort=True) for _ in range(2)])
    watchdog.start()
    time.sleep(0.05)
    world.leave()  # while the abort runs
    world.leave()
    watchdog.join()
    world.teardown(abort=True)
    assert events == ["abort", "destroy"]


def test_teardown_drops_the_graphs_first_and_holds_them_weakly(monkeypatch):
    """NCCL's destroy and abort wait until every graph that captured a collective is gone:
    whatever holds graphs is released before either, and a holder already gone is skipped."""
    from ostinato.distributed import world

    events: list[str] = []

    class Holder:
        def close(self) -> None:
            events.append("release")

    monkeypatch.setattr(world, "_destroy_all", lambda: events.append("destroy"))
    monkeypatch.setattr(world, "_abort_all", lambda: events.append("abort"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for abort in (False, True):
        monkeypatch.setattr(world, "_teardown", world._Teardown())
        monkeypatch.setattr(world, "_holders", [])
        kept, gone = Holder(), Holder()
        world.release_before_teardown(kept.close)
        world.release_before_teardown(gone.close)
        del gone
        events.clear()
        world.teardown(abort=abort)
        assert events == ["release", "abort" if abort else "destroy"]


def test_a_teardown_that_never_returns_is_left_at_its_deadline(monkeypatch, caplog):
    """An abort stuck in NCCL (a graph still holds the communicator) is left after
    TEARDOWN_S with a warning, and the leave after it does not queue behind it."""
    from ostinato.distributed import world

    calls, never = [], threading.Event()

    def stuck() -> None:
        calls.append("abort")
        never.wait()

    monkeypatch.setattr(world, "TEARDOWN_S", 0.2)
    monkeypatch.setattr(world, "_abort_all", stuck)
    monkeypatch.setattr(world, "_destroy_all", lambda: calls.append("destroy"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(world, "_teardown", world._Teardown())
    world._teardown.reset(nccl=True)  # gloo's ops run without a deadline
    try:
        with caplog.at_level(logging.WARNING, logger="ostinato"):
            world.teardown(abort=True)
            world.leave()
    finally:
        never.set()
    assert calls == ["abort"]
    assert "aborting the process groups did not finish in 0.2 s" in caplog.text
