"""Breakable capture and the graph runner on the CPU: the seam as a plain call, and capture
bookkeeping with torch.cuda's graph calls replaced by a recorder.

Nothing runs on a device here: these tests pin the order of segments, breaks, warm-ups and
captures, and what the runner does when a size runs out of memory. tests/gpu checks numbers.
"""

import contextlib
import itertools
import logging
import re
import warnings
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch
import triton.language as tl

from ostinato.config import EngineConfig
from ostinato.graphs import breakable
from ostinato.graphs.breakable import BreakableGraph, alias, run_outside_graph
from ostinato.graphs.capture import GraphRunner
from ostinato.graphs.modes import BatchDescriptor, CudaGraphMode
from ostinato.kernels import variants
from ostinato.kernels.dispatch import jit


def test_outside_capture_calls_fn_and_returns_out():
    calls = []

    def fn(a, b, out):
        calls.append((a, b))
        torch.add(a, b, out=out)

    a, b, out = torch.ones(3), torch.full((3,), 2.0), torch.empty(3)
    assert run_outside_graph(fn, a, b, out=out) is out
    assert torch.equal(out, torch.full((3,), 3.0)) and len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_alias_views_the_same_memory(dtype):
    base = torch.arange(12).reshape(3, 4).to(dtype)
    view = base[1:, ::2]
    a = alias(view)
    assert (a.data_ptr(), a.shape, a.stride()) == (view.data_ptr(), view.shape, view.stride())
    assert a.dtype == dtype
    a.fill_(-1)
    assert torch.equal(base[1:, ::2], torch.full((2, 2), -1, dtype=dtype))


EMPTY_GRAPH_WARNING = (
    "The CUDA Graph is empty. This usually means that the graph was attempted to be captured "
    "on wrong device or stream."
)


class Recorder:
    """Fake CUDA graphs that record what runs, and count the graphs using each memory pool as
    PyTorch does: a pool whose graphs are all gone is refused to the next capture."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.graphs = 0
        self.pools = itertools.count(1)
        self.pool_users: dict[tuple[int, int], int] = {}
        self.streams: list = []  # what each torch.cuda.stream(...) was given
        self.fail_end = False  # capture_end raises (a capture the error invalidated)
        self.empty_segments = False  # capture_end warns as torch does of an empty graph

    def pool_handle(self) -> tuple[int, int]:
        return 0, next(self.pools)

    def graph(self):
        rec, rec.graphs = self, self.graphs + 1
        gid = rec.graphs

        class FakeGraph:
            pool = None

            def capture_begin(self, pool=None):
                if rec.pool_users.get(pool) == 0:
                    raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")
                rec.pool_users[pool] = rec.pool_users.get(pool, 0) + 1
                self.pool = pool
                rec.events.append(("begin", gid))

            def capture_end(self):
                if rec.empty_segments:  # as torch warns of a graph that captured nothing
                    warnings.warn(EMPTY_GRAPH_WARNING, stacklevel=2)
                rec.events.append(("end", gid))
                if rec.fail_end:
                    raise RuntimeError("operation not permitted when stream is capturing")

            def replay(self):
                rec.events.append(("replay", gid))

            def __del__(self):
                if self.pool is not None:
                    rec.pool_users[self.pool] -= 1

        return FakeGraph()


class FakeStream:
    def wait_stream(self, other) -> None:
        pass


@pytest.fixture
def rec(monkeypatch) -> Recorder:
    rec = Recorder()
    fakes = {
        "CUDAGraph": rec.graph,
        "Stream": FakeStream,
        "current_stream": FakeStream,
        "stream": lambda s: rec.streams.append(s) or contextlib.nullcontext(),
        "graph_pool_handle": rec.pool_handle,
        "synchronize": lambda: None,
        "empty_cache": lambda: None,
        "mem_get_info": lambda: (2**30, 2**31),
    }
    for name, fake in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    # CPU memory is not a graph pool: a non-owning alias would outlive its memory here.
    monkeypatch.setattr(breakable, "alias", lambda t: t)
    return rec


def model(rec: Recorder, x: torch.Tensor) -> torch.Tensor:
    def attend(h, out):
        rec.events.append(("attend", h.shape[0]))
        out.copy_(h)

    for _ in range(2):
        x = run_outside_graph(attend, x + 1, out=torch.empty_like(x))
    return x * 2


def test_replay_alternates_segments_and_breaks(rec):
    stream = FakeStream()
    graph = BreakableGraph((0, 1), stream)
    out = graph.capture(lambda: model(rec, torch.zeros(4)))
    segments = [("begin", 1), ("end", 1), ("begin", 2), ("end", 2), ("begin", 3), ("end", 3)]
    assert rec.events == segments  # the attention calls did not run during capture
    assert rec.pool_users == {(0, 1): 3} and rec.streams == [stream]  # the graph's pool, stream
    rec.events.clear()
    assert graph.replay() is out and graph.num_breaks == 2
    replayed = ["replay 1", "attend 4", "replay 2", "attend 4", "replay 3"]
    assert [f"{what} {n}" for what, n in rec.events] == replayed


def test_each_break_sees_its_own_memo_in_every_replay_and_none_elsewhere(rec):
    """replay_memo(): during a replay, the dict of the break being run, the same one at every
    replay and another for each break; None during capture, between breaks, after a break
    that raised, and outside replays."""
    seen = []

    def attend(h, out):
        seen.append(breakable.replay_memo())
        out.copy_(h)

    def forward():
        x = run_outside_graph(attend, torch.zeros(2), out=torch.empty(2))
        seen.append(("between", breakable.replay_memo()))
        return run_outside_graph(attend, x, out=torch.empty(2))

    graph = BreakableGraph((0, 1), FakeStream())
    graph.capture(forward)
    assert seen == [("between", None)]
    seen.clear()
    graph.replay()
    first, second = seen
    assert isinstance(first, dict) and isinstance(second, dict) and first is not second
    first["bound"] = "kept"
    graph.replay()
    assert seen[2] is first and seen[3] is second and seen[2] == {"bound": "kept"}
    assert breakable.replay_memo() is None
    run_outside_graph(attend, torch.zeros(2), out=torch.empty(2))
    assert seen[-1] is None

    def broken(h, out):
        raise ValueError("kernel bug")

    failing = BreakableGraph((0, 1), FakeStream())
    failing.capture(lambda: run_outside_graph(broken, torch.zeros(2), out=torch.empty(2)))
    with pytest.raises(ValueError, match="kernel bug"):
        failing.replay()
    assert breakable.replay_memo() is None


def test_without_breaks_the_call_is_captured_inline(rec):
    graph = BreakableGraph((0, 1), FakeStream())
    graph.capture(lambda: model(rec, torch.zeros(4)), breaks=False)
    assert rec.events == [("begin", 1), ("attend", 4), ("attend", 4), ("end", 1)]
    assert graph.num_breaks == 0


@pytest.mark.parametrize("end_fails", [False, True])
def test_an_error_ends_the_open_segment_and_the_capture(rec, end_fails):
    """The open segment's capture ends and the model's error is the one reported, also where
    ending the capture fails too (CUDA invalidates a capture an error broke)."""

    def broken():
        run_outside_graph(lambda out: None, out=torch.empty(1))
        rec.fail_end = end_fails
        raise ValueError("model bug")

    with pytest.raises(ValueError, match="model bug"):
        BreakableGraph((0, 1), FakeStream()).capture(broken)
    assert rec.events == [("begin", 1), ("end", 1), ("begin", 2), ("end", 2)]
    calls = []
    run_outside_graph(lambda out: calls.append(out), out=torch.empty(1))
    assert len(calls) == 1  # no capture is under way any more


def test_a_capture_stopped_before_its_first_launch_ends_quietly(rec):
    """A capture stopped by its first launch (a cold kernel variant, which the runner warms up
    and captures again) ends an empty segment: torch's warning that capture went wrong would
    mislead, so it is not shown. An empty segment of a capture that went on still warns."""

    def cold():
        raise variants.ColdKernel("_double_kernel: a variant no warm-up launched")

    rec.empty_segments = True
    graphs = [BreakableGraph((0, 1), FakeStream()) for _ in range(2)]  # alive: the pool's users
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with pytest.raises(variants.ColdKernel):
            graphs[0].capture(cold)
    assert shown == []
    with pytest.warns(UserWarning, match="The CUDA Graph is empty"):
        graphs[1].capture(lambda: torch.zeros(1))


def test_one_breakable_capture_at_a_time(rec):
    inner = BreakableGraph((0, 1), FakeStream())

    def nested():
        inner.capture(lambda: torch.zeros(1))

    with pytest.raises(RuntimeError, match="^a breakable capture is already under way$"):
        BreakableGraph((0, 1), FakeStream()).capture(nested)


def test_breaking_answers_as_the_capture_the_forward_is_for(rec):
    """breaking(): True in a capture with breaks and in the warm-up of one, False in a capture
    without breaks (FULL), in the warm-up of one, and outside both."""
    seen = []

    def forward():
        seen.append(breakable.breaking())
        return torch.zeros(1)

    forward()
    graphs = [BreakableGraph((0, 1), FakeStream()) for _ in range(2)]  # alive: the pool's users
    graphs[0].capture(forward)
    graphs[1].capture(forward, breaks=False)
    for breaks in (True, False):
        with breakable.warm_up_for(breaks):
            forward()
    forward()
    assert seen == [False, True, False, True, False, False]


def test_runner_captures_largest_first_and_drops_what_runs_out_of_memory(rec):
    config = EngineConfig(
        device="cuda", capture_sizes=[1, 4, 16], max_num_seqs=16, max_num_batched_tokens=64
    )
    runner = GraphRunner(config)
    order = []

    def forward(desc: BatchDescriptor) -> torch.Tensor:
        order.append(desc)
        if desc == BatchDescriptor(16, 16, 1):
            raise torch.cuda.OutOfMemoryError("simulated")
        return model(rec, torch.zeros(desc.num_tokens))

    runner.capture(forward, prepare=lambda desc: order.append("prepare"))
    sizes = [d.num_tokens for d in order if d != "prepare"]
    assert sizes == sorted(sizes, reverse=True) and order[0] == "prepare"
    report = runner.report()
    dropped = {"num_tokens": 16, "num_reqs": 16, "uniform_query_len": 1, "num_active_loras": 0}
    assert report["dropped"] == [dropped]
    assert [len(report["captured"][m]) for m in ("full", "piecewise")] == [2, 3]
    mode, desc = runner.dispatch(10, 10, 1)  # its FULL graph is gone: piecewise instead
    assert (mode, desc) == (CudaGraphMode.PIECEWISE, BatchDescriptor.piecewise(16))
    rec.events.clear()
    runner.run(mode, desc, 10, lambda: pytest.fail("a captured key replays"))
    assert [e[0] for e in rec.events] == ["replay", "attend", "replay", "attend", "replay"]
    assert runner.report()["steps"]["piecewise"] == 1
    assert runner.report()["padded_tokens"] == 6
    # a key this process did not capture runs eagerly (another rank may hold its graph)
    gone = BatchDescriptor(16, 16, 1)
    assert runner.run(CudaGraphMode.FULL, gone, 16, lambda: "eager") == "eager"
    assert runner.report()["steps"]["none"] == 1


# ---- warm-ups once per kernel variant, and lazy capture -----------------------------------
@jit
def _double_kernel(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)


def double(x: torch.Tensor) -> torch.Tensor:
    """A real Triton kernel (interpreted here) whose variants follow Triton's integer
    specialisation of n: 1, a multiple of 16, anything else."""
    _double_kernel[(1,)](x, x.numel(), BLOCK=64)
    return x


@pytest.fixture
def kernels(monkeypatch):
    """Triton kernels run interpreted; the warm variants start empty."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(variants, "_launched", set())


def test_warm_only_refuses_a_variant_no_warm_up_launched_before_it_runs(kernels):
    x = torch.ones(4)
    with pytest.raises(variants.ColdKernel, match="_double_kernel"), variants.warm_only():
        double(x)
    assert torch.equal(x, torch.ones(4))  # stopped before the launch
    with variants.recording():
        double(torch.ones(4))
    with variants.warm_only():
        assert torch.equal(double(torch.ones(12)), torch.full((12,), 2.0))  # same variant
        for cold in (torch.ones(1), torch.ones(32), torch.ones(4, dtype=torch.float64)):
            with pytest.raises(variants.ColdKernel):
                double(cold)
    assert torch.equal(double(torch.ones(1)), torch.full((1,), 2.0))  # unwatched: runs


def lazy_forward(rec: Recorder, calls: list):
    def forward(desc: BatchDescriptor) -> torch.Tensor:
        calls.append(desc.num_tokens)
        return model(rec, double(torch.ones(desc.num_tokens)))

    return forward


def test_eager_capture_warms_up_once_per_kernel_variant(rec, kernels):
    sizes = [1, 2, 4, 16, 32]  # variants of n: {1}, {2, 4}, {16, 32}
    config = EngineConfig(device="cuda", capture_sizes=sizes, max_num_seqs=32)
    runner, calls = GraphRunner(config), []
    runner.capture(lazy_forward(rec, calls), prepare=lambda desc: None)
    report = runner.report()
    assert [len(report["captured"][m]) for m in ("full", "piecewise")] == [5, 5]
    # each variant: one capture stopped at the cold kernel, one warm-up, one capture
    assert report["warmups"] == 3 and len(calls) == 10 + 2 * 3
    assert report["cuda_graph_capture"] == "eager"


def test_lazy_capture_on_first_use(rec, kernels, caplog):
    config = EngineConfig(
        device="cuda", capture_sizes=[1, 4, 16], max_num_seqs=16, cuda_graph_capture="lazy"
    )
    runner, calls, eager_runs = GraphRunner(config), [], []
    with caplog.at_level(logging.INFO, logger="ostinato"):
        runner.capture(lazy_forward(rec, calls), prepare=lambda d: pytest.fail("no dummy batch"))
    assert caplog.messages == ["lazy CUDA graph capture: each graph is captured when first needed"]
    report = runner.report()
    assert not calls and not rec.events and report["captured"]["full"] == []
    assert (report["capture_seconds"], report["graph_memory_bytes"]) == (0.0, 0)
    assert (report["warmup_memory_bytes"], report["warmups"]) == (0, 0)

    def eager():  # the step's own forward, as the runner's: the padded sizes, same kernels
        eager_runs.append(1)
        double(torch.ones(4))
        return "eager output"

    full = runner.dispatch(3, 3, 1)
    # cold: the step runs eagerly as the warm-up, then its graph is captured
    assert runner.run(*full, 3, eager) == "eager output" and len(eager_runs) == 1
    assert runner.graphs[CudaGraphMode.FULL].keys() == {full[1]}
    rec.events.clear()
    out = runner.run(*full, 3, eager)  # captured: replays
    assert len(eager_runs) == 1 and out is runner.graphs[CudaGraphMode.FULL][full[1]].output
    assert rec.events and all(e[0] in ("replay", "attend") for e in rec.events)
    # warm: a new key of the same kernel variant is captured, then replayed, not run eagerly
    mode, desc = runner.dispatch(4, 2, None)
    assert (mode, desc) == (CudaGraphMode.PIECEWISE, BatchDescriptor.piecewise(4))
    rec.events.clear()
    runner.run(mode, desc, 4, eager)
    assert len(eager_runs) == 1 and rec.events[-1][0] == "replay"
    report = runner.report()
    assert report["cuda_graph_capture"] == "lazy" and report["warmups"] == 1
    assert report["steps"] == {"none": 1, "piecewise": 1, "full": 1}
    assert [len(report["captured"][m]) for m in ("full", "piecewise")] == [1, 1]
    assert report["capture_seconds"] > 0
    runner.run(CudaGraphMode.NONE, BatchDescriptor(600, 3, None), 600, eager)  # not graphable
    assert len(eager_runs) == 2 and sum(len(g) for g in runner.graphs.values()) == 2


def test_a_variant_that_stays_cold_after_its_warm_up_is_a_clear_error(rec, kernels):
    config = EngineConfig(device="cuda", capture_sizes=[4], max_num_seqs=4)
    sizes = iter([4, 16, 1])  # the "model" launches a new variant on every call

    def forward(desc: BatchDescriptor) -> torch.Tensor:
        return double(torch.ones(next(sizes)))

    with pytest.raises(RuntimeError, match="its own warm-up did not"):
        GraphRunner(config).capture(forward)


def test_graph_memory_counts_the_captures_and_warm_up_memory_apart(rec, kernels, monkeypatch):
    """Free memory falls by 8 MiB per captured graph (its pool and state) and by 100 MiB per
    warm-up (the first launches load kernel modules): graph memory counts only the first."""
    free = [2**31]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free[0], 2**32))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", taking_graph_memory(free, 8 * 2**20))
    monkeypatch.setattr(variants, "recording", taking_memory(variants.recording, free, 100 * 2**20))
    config = EngineConfig(device="cuda", capture_sizes=[1, 2, 4, 16, 32], max_num_seqs=32)
    runner = GraphRunner(config)
    runner.capture(lazy_forward(rec, []), prepare=lambda desc: None)
    report = runner.report()
    segments = sum(1 for event in rec.events if event[0] == "begin")
    # every capture attempt's segments count (a cold one stops in its first segment)
    assert report["graph_memory_bytes"] == segments * 8 * 2**20
    assert report["warmup_memory_bytes"] == report["warmups"] * 100 * 2**20 > 0


def test_full_prefill_keys_are_captured_whole_eagerly_and_lazily(rec, kernels):
    """FULL prefill keys are captured without breaks (attention inside the one graph), at
    start-up or on first use, and counted in the report."""
    sizes = {"capture_sizes": [1, 4, 64, 128], "max_num_seqs": 4, "max_num_batched_tokens": 128}
    runner = GraphRunner(EngineConfig(device="cuda", **sizes))
    runner.capture(lazy_forward(rec, []), prepare=lambda desc: None)
    full = runner.report()["captured"]["full"]
    keys = {(d["num_tokens"], d["num_reqs"]) for d in full if d["uniform_query_len"] is None}
    assert keys == {(64, 1), (64, 4), (128, 1), (128, 4)}
    step = runner.dispatch(100, 1, None)
    assert step == (CudaGraphMode.FULL, BatchDescriptor(128, 1, None))
    rec.events.clear()
    runner.run(*step, 100, lambda: pytest.fail("a captured key replays"))
    assert rec.events == [("replay", rec.events[0][1])]  # one graph, no eager attention
    assert runner.report()["full_prefill_steps"] == 1
    runner.run(*runner.dispatch(3, 3, 1), 3, lambda: pytest.fail("a captured key replays"))
    assert runner.report()["full_prefill_steps"] == 1  # a decode step is not one

    def eager():  # the step's own forward: the kernel variant of the padded size
        double(torch.ones(128))
        return "eager"

    variants._launched.clear()  # a cold start: the first use is the warm-up
    lazy = GraphRunner(EngineConfig(device="cuda", cuda_graph_capture="lazy", **sizes))
    lazy.capture(lazy_forward(rec, []), prepare=lambda desc: pytest.fail("no dummy batch"))
    step = lazy.dispatch(100, 3, None)
    assert step == (CudaGraphMode.FULL, BatchDescriptor(128, 4, None))
    assert lazy.run(*step, 100, eager) == "eager"
    rec.events.clear()
    lazy.run(*step, 100, lambda: pytest.fail("captured on first use"))
    assert [e[0] for e in rec.events] == ["replay"]
    report = lazy.report()
    assert report["steps"] == {"none": 1, "piecewise": 0, "full": 1}
    assert report["full_prefill_steps"] == 1  # the eager first use is no replay
    assert report["captured"]["full"] == [asdict(BatchDescriptor(128, 4, None))]


def test_eager_capture_prepares_each_key_on_the_side_stream_and_logs_what_it_took(
    rec, kernels, monkeypatch, caplog
):
    """Each key's dummy batch is prepared just before its capture; the captures run on the
    side stream, which first waits for the current stream, and the current stream waits for it
    after; capture_seconds is the clock's difference and the log line gives the graphs by mode,
    the seconds, the warm-ups and both memories in MiB."""
    from ostinato.graphs import capture as capture_module

    now = [100.0]  # each forward takes half a second of the capture module's clock
    monkeypatch.setattr(capture_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    free = [2**31]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free[0], 2**32))
    monkeypatch.setattr(variants, "recording", taking_memory(variants.recording, free, 2**20))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", taking_graph_memory(free, 2**19))
    bars = []
    fake_tqdm = lambda todo, **kwargs: bars.append(kwargs) or todo  # noqa: E731
    monkeypatch.setattr(capture_module, "tqdm", fake_tqdm)
    waits = []
    monkeypatch.setattr(FakeStream, "wait_stream", lambda s, other: waits.append((s, other)))
    order = []

    def forward(desc: BatchDescriptor) -> torch.Tensor:
        order.append(("forward", desc))
        if variants.mode == variants.RECORD:  # a warm-up takes the paths its capture will
            assert breakable.breaking() is (desc.num_reqs is None)  # PIECEWISE keys: no reqs
        now[0] += 0.5
        return model(rec, double(torch.ones(desc.num_tokens)))

    config = EngineConfig(device="cuda", capture_sizes=[1, 2, 16], max_num_seqs=16)
    runner = GraphRunner(config)
    with caplog.at_level(logging.INFO, logger="ostinato"):
        runner.capture(forward, prepare=lambda desc: order.append(("prepare", desc)))
    prepared = None
    for what, desc in order:
        assert what == "prepare" or desc == prepared  # every capture and warm-up of its key
        prepared = desc if what == "prepare" else prepared
    assert sum(what == "prepare" for what, _ in order) == 6  # one per key: 3 FULL, 3 PIECEWISE
    (side,) = set(rec.streams)
    assert [w[0] is side for w in waits] == [True, False] and waits[1][1] is side
    assert waits[0][1] is not None
    report = runner.report()
    seconds = 0.5 * sum(what == "forward" for what, _ in order)
    assert report["capture_seconds"] == seconds > 0 and report["warmups"] == 3
    graph_mib = sum(e[0] == "begin" for e in rec.events) / 2  # half a MiB a segment
    assert report["graph_memory_bytes"] == graph_mib * 2**20 > 0
    assert report["warmup_memory_bytes"] == 3 * 2**20  # one variant of n per size
    assert bars == [{"desc": "Capturing CUDA graphs", "disable": None}]  # off without a TTY
    assert caplog.messages[-1] == (
        f"captured 3 full, 3 piecewise in {seconds:.2f} s (3 warm-ups), {graph_mib:.1f} MiB of "
        "graph memory (+3.0 MiB that the warm-ups' first kernel launches took)"
    )


def taking_graph_memory(free: list, nbytes: int):
    """torch.cuda.CUDAGraph (the recorder's) whose every capture takes nbytes of free memory."""
    make_graph = torch.cuda.CUDAGraph

    def graph():
        graph = make_graph()
        begin = graph.capture_begin

        def capture_begin(pool=None):
            free[0] -= nbytes
            begin(pool)

        graph.capture_begin = capture_begin
        return graph

    return graph


def taking_memory(recording, free: list, nbytes: int):
    """variants.recording (a warm-up) that takes nbytes of the fake free memory."""

    @contextlib.contextmanager
    def warm_up():
        free[0] -= nbytes
        with recording():
            yield

    return warm_up


def test_replays_check_the_buffers_addresses_only_with_debug_graph_addresses(rec):
    """debug_graph_addresses: every replay compares each persistent buffer's address with the
    one captured, and a moved buffer is a clear error naming it and both addresses; without
    the flag nothing is checked."""
    bufs = {"input_ids": torch.zeros(16), "positions": torch.zeros(16)}
    for debug in (True, False):
        config = EngineConfig(
            device="cuda", capture_sizes=[16], max_num_seqs=16, debug_graph_addresses=debug
        )
        runner = GraphRunner(config)
        runner.capture(lambda d: model(rec, torch.zeros(d.num_tokens)), buffers=lambda: bufs)
        mode, desc = runner.dispatch(10, 10, 1)
        runner.run(mode, desc, 10, lambda: pytest.fail("a captured key replays"))
        old, bufs["positions"] = bufs["positions"].data_ptr(), torch.zeros(16)
        if not debug:
            runner.run(mode, desc, 10, lambda: pytest.fail("a captured key replays"))
            continue
        new = bufs["positions"].data_ptr()
        message = (
            f"persistent buffer 'positions' moved since capture ({old:#x} -> {new:#x}): graphs "
            "read the captured address, so copy into the buffer instead of replacing it"
        )
        with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
            runner.run(mode, desc, 10, lambda: pytest.fail("a captured key replays"))


def test_the_report_counts_replays_by_mode_query_length_and_adapter_count(rec):
    config = EngineConfig(device="cuda", capture_sizes=[1, 4, 16], max_num_seqs=16)
    runner = GraphRunner(config)
    runner.capture(lambda d: model(rec, torch.zeros(d.num_tokens)))
    padding = 0
    for tokens, reqs, uniform in [(3, 3, 1), (4, 4, 1), (1, 1, 1), (12, 3, 4), (9, 2, None)]:
        mode, desc = runner.dispatch(tokens, reqs, uniform)
        runner.run(mode, desc, tokens, lambda: pytest.fail("a captured key replays"))
        padding += desc.num_tokens - tokens
    for _ in range(2):
        assert runner.run(CudaGraphMode.NONE, BatchDescriptor.piecewise(5), 5, lambda: 7) == 7
    report = runner.report()
    assert report["padded_tokens"] == padding == 1 + 4 + 7
    assert report["steps"] == {"none": 2, "piecewise": 2, "full": 3}
    assert report["full_decode_steps"] == {"1": 3}
    assert report["replays_by_active_loras"] == {"0": 5}


@pytest.mark.parametrize("tensor_ranks", [1, 2])
def test_out_of_memory_in_a_warm_up_drops_the_size_or_stops_a_tensor_parallel_rank(
    rec, kernels, tensor_ranks
):
    """A warm-up (a cold kernel variant's) that runs out of memory drops its size on a single
    rank, where capture carries on; a tensor-parallel rank must stop instead, with the size and
    the fix: its peers wait in the warm-up's collectives, which it would never issue."""
    config = EngineConfig(
        device="cuda", capture_sizes=[1, 4], max_num_seqs=4, tensor_parallel_size=tensor_ranks
    )
    runner, calls = GraphRunner(config), []

    def forward(desc: BatchDescriptor) -> torch.Tensor:
        if variants.mode == variants.RECORD and desc.num_tokens == 4:  # size 4's warm-up
            raise torch.cuda.OutOfMemoryError("simulated")
        return lazy_forward(rec, calls)(desc)

    if tensor_ranks == 1:
        runner.capture(forward, prepare=lambda desc: None)
        assert {d.num_tokens for d in runner.dropped} == {4}
        assert runner.report()["captured"]["full"] == [asdict(BatchDescriptor(1, 1, 1))]
        return
    message = (
        "out of memory in the eager warm-up of {desc}: the tensor-parallel peers of this rank "
        "wait in collectives it will not issue, so the engine stops; lower "
        "gpu_memory_utilization or max_num_batched_tokens / max_capture_size"
    )
    with pytest.raises(RuntimeError) as error:
        runner.capture(forward, prepare=lambda desc: None)
    first = runner.dispatcher.descriptors()[CudaGraphMode.FULL][-1]  # the largest, captured first
    assert str(error.value) == message.format(desc=first)
    assert isinstance(error.value.__cause__, torch.cuda.OutOfMemoryError)


@jit
def _keyed_kernel(x_ptr, n, scale, flag, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), scale, mask=(tl.arange(0, BLOCK) < n) & flag)


def test_launch_keys_tell_apart_what_triton_specialises_on():
    """A warm-up must have launched the variant a capture launches: the key holds, per
    argument, what Triton compiles a new variant for (a tensor's dtype and 16-byte alignment;
    an integer's being 1, a multiple of 16, within int32; a bool's value; every constexpr and
    launch option's value) and nothing else (pointers' values, other integers, floats)."""
    x = torch.zeros(64)

    def key(*args, **kwargs):
        return variants.launch_key(_keyed_kernel, args, {"BLOCK": 64, "num_warps": 4, **kwargs})

    base = key(x, 5, 0.5, True)
    same = [
        key(x[4:], 5, 0.5, True),  # another aligned pointer
        key(x, 7, 0.5, True),  # another integer of the same class
        key(x, 5, 0.25, True),  # another float
        key(x, 5, 0.5, True, num_warps=4),
    ]
    differ = [
        key(x[1:], 5, 0.5, True),  # 4 bytes in: not aligned
        key(x.to(torch.float16), 5, 0.5, True),
        key(x, 1, 0.5, True),
        key(x, 32, 0.5, True),
        key(x, 2**31 + 1, 0.5, True),  # past int32
        key(x, 5, 0.5, False),
        key(x, 5, 0.5, True, BLOCK=128),  # a constexpr
        key(x, 5, 0.5, True, num_warps=8),  # a launch option
    ]
    assert all(k == base for k in same)
    assert all(k != base for k in differ) and len(set(differ)) == len(differ)
    # int32's edges: in range at -2**31 and 2**31 - 1, out just past them
    assert key(x, 2**31 - 1, 0.5, True) == base != key(x, 2**31 + 3, 0.5, True)
    assert key(x, -(2**31), 0.5, True) == key(x, 32, 0.5, True) != key(x, 2**31, 0.5, True)
    assert key(x, -(2**31) - 16, 0.5, True) != key(x, 32, 0.5, True)
    positional = variants.launch_key(_keyed_kernel, (x, 5, 0.5, True, 64), {})
    assert positional != variants.launch_key(_keyed_kernel, (x, 5, 0.5, True, 128), {})
    by_keyword = variants.launch_key(_keyed_kernel, (x,), {"n": 5, "scale": 0.5, "flag": True})
    assert by_keyword == variants.launch_key(
        _keyed_kernel, (x,), {"n": 9, "scale": 2.0, "flag": True}
    )
    assert by_keyword != variants.launch_key(
        _keyed_kernel, (x,), {"n": 1, "scale": 0.5, "flag": True}
    )
