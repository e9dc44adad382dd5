"""The graph runtime the model runner drives: resolve, dispatch, capture, replay, report."""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from typing import TypeVar

import torch
from tqdm import tqdm

from ostinato.config import EngineConfig
from ostinato.graphs.breakable import BreakableGraph
from ostinato.graphs.compat import resolve
from ostinato.graphs.dispatcher import Dispatcher
from ostinato.graphs.modes import RUNTIME_MODES, BatchDescriptor, CudaGraphMode
from ostinato.graphs.plan import CapturePlan

logger = logging.getLogger("ostinato")

ForwardFn = Callable[[BatchDescriptor], torch.Tensor]
Prepare = Callable[[BatchDescriptor], None]
Buffers = Callable[[], Mapping[str, torch.Tensor]]
T = TypeVar("T")


@contextmanager
def frozen_gc() -> Iterator[None]:
    """Collect once, then freeze what exists, so collections triggered during capture walk only
    the objects capture creates instead of every model object, again and again."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class GraphRunner:
    """Owns every CUDA graph of one engine. The runner calls, in order:

    dispatch(num_tokens, num_reqs, uniform_query_len) -> (mode, desc) for every step, on the
    driver only (every rank then runs the driver's decision);
    capture(forward_fn, prepare, buffers) once at start-up, after the KV cache exists;
    run(mode, desc, num_tokens, eager) for every step, after copying the batch into the
    persistent buffers and inside the step's forward context (breaks read it);
    report() for graph_report().
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        plan = CapturePlan.from_config(config)
        self.resolution = resolve(config, plan)
        self.resolution.log()
        self.dispatcher = Dispatcher(self.resolution.resolved, plan)
        self.graphs: dict[CudaGraphMode, dict[BatchDescriptor, BreakableGraph]] = {
            CudaGraphMode.FULL: {},
            CudaGraphMode.PIECEWISE: {},
        }
        self.dropped: list[BatchDescriptor] = []
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0
        self.steps: Counter[CudaGraphMode] = Counter()
        self.padded_tokens = 0
        self._buffers: Buffers | None = None
        self._addresses: dict[str, int] = {}

    @property
    def mode(self) -> CudaGraphMode:
        return self.resolution.resolved

    def dispatch(
        self, num_tokens: int, num_reqs: int, uniform_query_len: int | None
    ) -> tuple[CudaGraphMode, BatchDescriptor]:
        """The runtime mode and padded key of one step."""
        return self.dispatcher.dispatch(num_tokens, num_reqs, uniform_query_len)

    def run(
        self, mode: CudaGraphMode, desc: BatchDescriptor, num_tokens: int, eager: Callable[[], T]
    ) -> T:
        """Replay the graph of desc, or call eager() for NONE and for a key this process did
        not capture (another rank may have: the collectives inside are the same either way).
        A replay returns the captured output, valid until the graph's next replay."""
        graph = self.graphs[mode].get(desc) if mode is not CudaGraphMode.NONE else None
        ran = mode if graph is not None else CudaGraphMode.NONE
        self.steps[ran] += 1
        self.padded_tokens += desc.num_tokens - num_tokens
        if graph is None:
            return eager()
        if self._buffers is not None:
            self._check_addresses()
        return graph.replay()

    def capture(
        self,
        forward_fn: ForwardFn,
        prepare: Prepare | None = None,
        buffers: Buffers | None = None,
    ) -> None:
        """Capture every key the dispatcher can return, largest first.

        prepare(desc) writes a dummy batch of desc's sizes into the persistent buffers (host
        to device copies belong here, never in a graph). forward_fn(desc) then runs the model
        on the buffers sliced to desc's sizes, under a forward context built from them, and
        returns a tensor; it must launch device work only. `buffers` returns the persistent
        buffers by name: with debug_graph_addresses every replay checks they have not moved.
        A size whose capture runs out of memory is dropped with a warning; its batches pad
        up to a larger graph or run eagerly.
        """
        todo = [(m, d) for m, descs in self.dispatcher.descriptors().items() for d in descs]
        if not todo:
            return
        todo.sort(key=lambda md: md[1].num_tokens, reverse=True)  # smaller graphs reuse memory
        if self.config.debug_graph_addresses and buffers is not None:
            self._buffers = buffers
            self._addresses = {name: t.data_ptr() for name, t in buffers().items()}
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        with frozen_gc():  # collects first, so the memory baseline is clean
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            free_before, start = torch.cuda.mem_get_info()[0], time.perf_counter()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for mode, desc in tqdm(todo, desc="Capturing CUDA graphs", disable=None):
                    if not self._capture_one(mode, desc, forward_fn, prepare, pool, stream):
                        # only now has the traceback let go of the partial graph and its tensors
                        torch.cuda.empty_cache()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # give back the warm-ups' memory before measuring
            self.capture_seconds = time.perf_counter() - start
            self.graph_memory_bytes = free_before - torch.cuda.mem_get_info()[0]
        if self.dropped:
            self.dispatcher = self.dispatcher.without(self.dropped)
            logger.warning("out of memory while capturing: dropped graphs %s", self.dropped)
        logger.info(
            "captured %s in %.2f s, %.1f MiB of graph memory",
            ", ".join(f"{len(g)} {m.value}" for m, g in self.graphs.items() if g) or "no graphs",
            self.capture_seconds,
            self.graph_memory_bytes / 2**20,
        )

    def _capture_one(self, mode, desc, forward_fn, prepare, pool, stream) -> bool:
        """Prepare, warm up and capture one key; False when it ran out of memory."""
        torch.cuda.synchronize()  # the previous dummy batch's copies are done with the host side
        try:
            if prepare is not None:
                prepare(desc)
            forward_fn(desc)  # lazy initialisation and autotuning happen here, not in capture
            graph = BreakableGraph(pool, stream)
            graph.capture(lambda: forward_fn(desc), breaks=mode is CudaGraphMode.PIECEWISE)
        except torch.cuda.OutOfMemoryError:
            self.dropped.append(desc)
            return False
        self.graphs[mode][desc] = graph
        return True

    def _check_addresses(self) -> None:
        for name, t in self._buffers().items():
            if t.data_ptr() != self._addresses.get(name):
                raise RuntimeError(
                    f"persistent buffer {name!r} moved since capture "
                    f"({self._addresses.get(name, 0):#x} -> {t.data_ptr():#x}): graphs read the "
                    "captured address, so copy into the buffer instead of replacing it"
                )

    def report(self) -> dict:
        """JSON-ready: the resolution, what was captured and dropped, and step counts."""
        return {
            **self.resolution.as_dict(),
            "captured": {m.value: [asdict(d) for d in g] for m, g in self.graphs.items()},
            "dropped": [asdict(d) for d in self.dropped],
            "capture_seconds": self.capture_seconds,
            "graph_memory_bytes": self.graph_memory_bytes,
            "steps": {m.value: self.steps[m] for m in RUNTIME_MODES},
            "padded_tokens": self.padded_tokens,
        }
