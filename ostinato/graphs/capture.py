"""The graph runtime the model runner drives: resolve, dispatch, capture, replay, report."""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from functools import partial
from typing import TypeVar

import torch
from tqdm import tqdm

from ostinato.config import EngineConfig
from ostinato.graphs.breakable import BreakableGraph, warm_up_for
from ostinato.graphs.compat import resolve
from ostinato.graphs.dispatcher import Dispatcher
from ostinato.graphs.modes import RUNTIME_MODES, BatchDescriptor, CudaGraphMode
from ostinato.kernels import variants

logger = logging.getLogger("ostinato")

ForwardFn = Callable[[BatchDescriptor], torch.Tensor]
Prepare = Callable[[BatchDescriptor], None]
Buffers = Callable[[], Mapping[str, torch.Tensor]]
T = TypeVar("T")
Agree = Callable[[int], int]  # an outcome code -> the largest over the stage's ranks

CAPTURED, COLD, OUT_OF_MEMORY = 0, 1, 2  # one capture attempt's outcome, in agreement order


@contextmanager
def paused_gc() -> Iterator[None]:
    """No collection during one capture while serving: a full collection walks every object."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def frozen_gc() -> Iterator[None]:
    """Freeze what exists, so collections triggered during capture walk only the objects
    capture creates instead of every model object, again and again. The young generations are
    collected first (the loader's garbage); a full collection walked every object of torch,
    transformers and the model for 0.24 s of start-up, and garbage left in the old generation
    stays put while frozen, so the memory capture measures (a difference) is the same."""
    gc.collect(1)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class GraphRunner:
    """Owns every CUDA graph of one engine. The runner calls, in order:

    dispatch(num_tokens, num_reqs, uniform_query_len, num_active_loras) -> (mode, desc) for
    every step, on the driver only (every rank then runs the driver's decision);
    capture(forward_fn, prepare, buffers) once at start-up, after the KV cache exists: eager
    capture captures every key now, lazy capture keeps forward_fn and captures each key the
    first time run() is given it;
    run(mode, desc, num_tokens, eager) for every step, after copying the batch into the
    persistent buffers and inside the step's forward context (breaks read it);
    report() for graph_report().

    Warm-ups: a capture runs under variants.warm_only(), so one that would launch a Triton
    kernel variant no warm-up launched stops before compiling it; only then does the key get
    an eager warm-up (recorded) and a second capture. Keys of one kernel variant set share a
    warm-up.

    Agreement: with tensor parallelism a warm-up runs real all-reduces while a capture
    communicates nothing, so whether a key is warmed up, dropped or captured must be the same
    on every rank of the stage, though it is decided from process-local state (which kernel
    variants this process launched before, possibly for an earlier engine; out-of-memory).
    Each rank reports its outcome and `agree` (the largest over the stage's ranks, one small
    gloo all-reduce) picks the path they all take: a cold kernel anywhere warms up
    everywhere, out of memory anywhere drops the key everywhere. An eager warm-up that runs
    out of memory cannot be undone (its peers wait in a collective it will not issue): with
    several ranks that stops the engine with a clear error.

    Lazy capture is deterministic: every rank sees the same keys in the same order, so all
    capture a key at the same step. A key's first use captures then replays when every kernel
    variant is warm, else runs the step eagerly, recording it as the warm-up, then captures.
    (A capture costs about an eager forward's host time: a warm key saves that forward, and a
    cold one needs a warm-up anyway, which the live step is.) Capture runs no kernels, so
    capturing from the live buffers has no effect on the step; later steps replay. Every key
    of qwen3-0.6b captured smallest first took 196 MiB against the 231 MiB the KV sizing
    reserves for graphs (H100, benchmarks/capture-h100.md).
    """

    def __init__(self, config: EngineConfig, agree: Agree | None = None) -> None:
        self.config = config
        self.agree: Agree = agree or (lambda outcome: outcome)
        self.resolution = resolve(config)
        self.resolution.log()
        self.dispatcher = Dispatcher(self.resolution.resolved, self.resolution.plan)
        self.lazy = config.cuda_graph_capture == "lazy"
        self.graphs: dict[CudaGraphMode, dict[BatchDescriptor, BreakableGraph]] = {
            CudaGraphMode.FULL: {},
            CudaGraphMode.PIECEWISE: {},
        }
        self.dropped: list[BatchDescriptor] = []
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0
        self.warmup_memory_bytes = 0  # eager capture: what its warm-ups' first launches took
        self.num_warmups = 0
        self.steps: Counter[CudaGraphMode] = Counter()
        self.full_decode_steps: Counter[int] = Counter()  # FULL decode replays per query length
        self.full_prefill_steps = 0  # replays of FULL prefill keys
        self.replays_by_loras: Counter[int] = Counter()  # graph replays per active-adapter count
        self.padded_tokens = 0
        self._forward_fn: ForwardFn | None = None
        self._pool: tuple[int, int] | None = None
        self._stream: torch.cuda.Stream | None = None
        self._buffers: Buffers | None = None
        self._addresses: dict[str, int] = {}

    def close(self) -> None:
        """Drop every graph, the pool they share and the side stream; counters stay."""
        for graphs in self.graphs.values():
            graphs.clear()
        self._pool = self._stream = self._forward_fn = self._buffers = None

    @property
    def mode(self) -> CudaGraphMode:
        return self.resolution.resolved

    def dispatch(
        self,
        num_tokens: int,
        num_reqs: int,
        uniform_query_len: int | None,
        num_active_loras: int = 0,
    ) -> tuple[CudaGraphMode, BatchDescriptor]:
        """The runtime mode and padded key of one step."""
        return self.dispatcher.dispatch(num_tokens, num_reqs, uniform_query_len, num_active_loras)

    def run(
        self, mode: CudaGraphMode, desc: BatchDescriptor, num_tokens: int, eager: Callable[[], T]
    ) -> T:
        """Replay the graph of desc, or call eager() for NONE and for a key this process did
        not capture (another rank may have: the collectives inside are the same either way).
        With lazy capture, a key's first use captures it. A replay returns the captured
        output, valid until the graph's next replay."""
        self.padded_tokens += desc.num_tokens - num_tokens
        if mode is CudaGraphMode.NONE:
            return self._eager(eager)
        graph = self.graphs[mode].get(desc)
        if graph is None and self._pending(desc):
            return self._first_use(mode, desc, eager)
        if graph is None:
            return self._eager(eager)
        return self._replay(mode, desc, graph)

    def _eager(self, eager: Callable[[], T]) -> T:
        self.steps[CudaGraphMode.NONE] += 1
        return eager()

    def _replay(
        self, mode: CudaGraphMode, desc: BatchDescriptor, graph: BreakableGraph
    ) -> torch.Tensor:
        self.steps[mode] += 1
        if desc.uniform_query_len is not None:
            self.full_decode_steps[desc.uniform_query_len] += 1
        elif self.dispatcher.is_full_prefill(desc):
            self.full_prefill_steps += 1
        if self._buffers is not None:
            self._check_addresses()
        self.replays_by_loras[desc.num_active_loras] += 1
        return graph.replay()

    def _pending(self, desc: BatchDescriptor) -> bool:
        return self.lazy and self._forward_fn is not None and desc not in self.dropped

    def _first_use(self, mode: CudaGraphMode, desc: BatchDescriptor, eager: Callable[[], T]) -> T:
        """Capture then replay when every kernel variant is warm; else run this step eagerly
        as the warm-up, then capture. Either way the step is computed once."""
        ran: list[T] = []
        graph = self._capture_one(mode, desc, lambda: ran.append(self._eager(eager)))
        if ran:
            return ran[0]
        return self._replay(mode, desc, graph) if graph is not None else self._eager(eager)

    def capture(
        self,
        forward_fn: ForwardFn,
        prepare: Prepare | None = None,
        buffers: Buffers | None = None,
    ) -> None:
        """Eager capture: capture every key the dispatcher can return, largest first. Lazy
        capture: only keep forward_fn for run().

        prepare(desc) writes a dummy batch of desc's sizes into the persistent buffers (host
        to device copies belong here, never in a graph). forward_fn(desc) then runs the model
        on the buffers sliced to desc's sizes, under a forward context built from them, and
        returns a tensor; it must launch device work only. `buffers` returns the persistent
        buffers by name: with debug_graph_addresses every replay checks they have not moved.
        A size whose capture runs out of memory is dropped with a warning; its batches pad
        up to a larger graph (eager capture) or run eagerly (lazy capture).
        """
        self._forward_fn = forward_fn
        if self.config.debug_graph_addresses and buffers is not None:
            self._buffers = buffers
            self._addresses = {name: t.data_ptr() for name, t in buffers().items()}
        if self.lazy:
            logger.info("lazy CUDA graph capture: each graph is captured when first needed")
            return
        todo = [(m, d) for m, descs in self.dispatcher.descriptors().items() for d in descs]
        if not todo:
            return
        todo.sort(key=lambda md: md[1].num_tokens, reverse=True)  # smaller graphs reuse memory
        with frozen_gc():  # nothing from before capture is freed while it measures
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            free_before, start = torch.cuda.mem_get_info()[0], time.perf_counter()
            stream = self._capture_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-ups too: cuBLAS sets up this stream once
                for mode, desc in tqdm(todo, desc="Capturing CUDA graphs", disable=None):
                    torch.cuda.synchronize()  # the last dummy batch's copies left the host side
                    if prepare is not None:
                        prepare(desc)
                    if self._capture_one(mode, desc, partial(forward_fn, desc)) is None:
                        # only now has the traceback let go of the partial graph and its tensors
                        torch.cuda.empty_cache()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # give back the warm-ups' memory before measuring
            self.capture_seconds = time.perf_counter() - start
            taken = free_before - torch.cuda.mem_get_info()[0]
            self.warmup_memory_bytes = taken - self.graph_memory_bytes
        if self.dropped:
            self.dispatcher = self.dispatcher.without(self.dropped)
        logger.info(
            "captured %s in %.2f s (%d warm-ups), %.1f MiB of graph memory (+%.1f MiB that the "
            "warm-ups' first kernel launches took)",
            ", ".join(f"{len(g)} {m.value}" for m, g in self.graphs.items() if g) or "no graphs",
            self.capture_seconds,
            self.num_warmups,
            self.graph_memory_bytes / 2**20,
            self.warmup_memory_bytes / 2**20,
        )

    def _capture_stream(self) -> torch.cuda.Stream:
        """The side stream and the memory pool every capture uses (capture needs a side
        stream)."""
        if self._stream is None:
            self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        return self._stream

    def _discarded(self) -> None:
        """After a capture that became no graph (a cold kernel, out of memory). PyTorch counts
        the graphs using a pool; a discarded one that was the only one leaves the count at 0,
        and PyTorch's allocators then refuse that pool to the next capture (an internal
        assert). So until some graph holds the pool, the next capture takes a fresh one."""
        if not any(self.graphs.values()):
            self._pool = torch.cuda.graph_pool_handle()

    def _capture_one(
        self, mode: CudaGraphMode, desc: BatchDescriptor, warm_up: Callable[[], object]
    ) -> BreakableGraph | None:
        """Capture desc, calling warm_up() first when a capture meets a cold kernel variant
        on any rank of the stage. None when a capture ran out of memory on any rank: desc is
        dropped everywhere."""
        graph, outcome = self._attempt(mode, desc)
        if outcome == COLD:  # every rank warms up and captures again, with the same collectives
            graph, outcome = None, OUT_OF_MEMORY
            if self._warm_up(mode, desc, warm_up):
                graph, outcome = self._attempt(mode, desc)
            if outcome == COLD:
                raise RuntimeError(
                    f"capturing {mode.value} {desc} launched a kernel variant that its own "
                    "warm-up did not: a launch key depends on something other than shapes"
                )
        if outcome == OUT_OF_MEMORY:
            self.dropped.append(desc)
            self._discarded()
            logger.warning("out of memory while capturing: dropped the graph of %s", desc)
            return None
        self.graphs[mode][desc] = graph
        return graph

    def _attempt(
        self, mode: CudaGraphMode, desc: BatchDescriptor
    ) -> tuple[BreakableGraph | None, int]:
        """One capture attempt on this rank, then the outcome every rank of the stage agreed
        on (a capture communicates nothing, so ranks may disagree here safely)."""
        graph, outcome = None, CAPTURED
        try:
            graph = self._capture_warm(mode, desc)
            outcome = COLD if graph is None else CAPTURED
        except torch.cuda.OutOfMemoryError:
            outcome = OUT_OF_MEMORY
        agreed = self.agree(outcome)
        if agreed != CAPTURED and graph is not None:
            graph = None  # another rank's outcome wins: this one's graph is not kept
            self._discarded()
        return graph, agreed

    def _warm_up(
        self, mode: CudaGraphMode, desc: BatchDescriptor, warm_up: Callable[[], object]
    ) -> bool:
        """Run the eager warm-up, taking the paths the capture will (breakable.warm_up_for);
        False when it ran out of memory in a single-rank stage (desc is dropped)."""
        try:
            with variants.recording(), warm_up_for(mode is CudaGraphMode.PIECEWISE):
                warm_up()
        except torch.cuda.OutOfMemoryError as e:
            if self.config.tensor_parallel_size == 1:
                return False
            raise RuntimeError(
                f"out of memory in the eager warm-up of {desc}: the tensor-parallel peers "
                "of this rank wait in collectives it will not issue, so the engine stops; "
                "lower gpu_memory_utilization or max_num_batched_tokens / max_capture_size"
            ) from e
        self.num_warmups += 1
        return True

    def _capture_warm(self, mode: CudaGraphMode, desc: BatchDescriptor) -> BreakableGraph | None:
        """One capture attempt; None when it stopped at a cold kernel variant."""
        stream = self._capture_stream()
        graph = BreakableGraph(self._pool, stream)
        try:
            with self._totals(), variants.warm_only(), paused_gc():
                graph.capture(
                    lambda: self._forward_fn(desc), breaks=mode is CudaGraphMode.PIECEWISE
                )
        except variants.ColdKernel:
            self._discarded()
            return None
        return graph

    @contextmanager
    def _totals(self) -> Iterator[None]:
        """Graph memory is what the capture windows take (the pool grows, the graphs keep
        their state); what a warm-up's first kernel launches take (module loads, the capture
        stream's cuBLAS workspace) is counted apart, under warmup_memory_bytes. A lazy capture
        also adds its seconds, leaving out the step it may follow; eager capture times its
        whole loop, warm-ups included."""
        free_before, start = torch.cuda.mem_get_info()[0], time.perf_counter()
        try:
            yield
        finally:
            self.graph_memory_bytes += free_before - torch.cuda.mem_get_info()[0]
            if self.lazy:
                self.capture_seconds += time.perf_counter() - start

    def _check_addresses(self) -> None:
        for name, t in self._buffers().items():
            if t.data_ptr() != self._addresses.get(name):
                raise RuntimeError(
                    f"persistent buffer {name!r} moved since capture "
                    f"({self._addresses.get(name, 0):#x} -> {t.data_ptr():#x}): graphs read the "
                    "captured address, so copy into the buffer instead of replacing it"
                )

    def report(self) -> dict:
        """JSON-ready: the resolution, what was captured and dropped, step counts, and graph
        replays per active-adapter count (keys are counts as strings)."""
        return {
            **self.resolution.as_dict(),
            "cuda_graph_capture": self.config.cuda_graph_capture,
            "captured": {m.value: [asdict(d) for d in g] for m, g in self.graphs.items()},
            "dropped": [asdict(d) for d in self.dropped],
            "capture_seconds": self.capture_seconds,
            "graph_memory_bytes": self.graph_memory_bytes,
            "warmup_memory_bytes": self.warmup_memory_bytes,
            "warmups": self.num_warmups,
            "steps": {m.value: self.steps[m] for m in RUNTIME_MODES},
            "full_decode_steps": {str(q): n for q, n in sorted(self.full_decode_steps.items())},
            "full_prefill_steps": self.full_prefill_steps,
            "padded_tokens": self.padded_tokens,
            "replays_by_active_loras": {
                str(k): n for k, n in sorted(self.replays_by_loras.items())
            },
        }
