"""Breakable capture: a CUDA graph cut into segments with eager calls between them.

The attention layer calls `run_outside_graph(fn, *tensors, out=out)`. Outside a breakable
capture that is just `fn(*tensors, out)`. During one, the current segment ends, the call is
recorded, and the next segment begins on the same stream in the same memory pool. Replay runs
segment, call, segment, ...: each call runs eagerly on the tensors captured at its place,
and reads the live batch metadata (from the forward context) at that moment. Since those
tensors are the same at every replay, each call also sees a memo of its own (replay_memo)
for what it derives from them alone: the attention launch binds its arguments there.

Memory: every segment allocates from the one pool, and tensors that cross a break are held
by the Python frames of the forward pass while capture runs, so no segment reuses them.
Afterwards the recorded calls keep only non-owning aliases: the pool may hand those blocks
to graphs captured later, which is safe because graphs never replay
concurrently and every block a replay reads was written earlier in the same replay. Only the
final output stays owned, so it is stable until this graph's next replay.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from functools import partial

import torch

_capturing: BreakableGraph | None = None  # the breakable capture under way, if any
_warming_up = False  # the eager warm-up of a breakable capture under way
_replaying: dict | None = None  # the memo of the break a replay is running, if any


def breaking() -> bool:
    """Whether run_outside_graph's calls are breaks now, or are to be in the capture whose
    warm-up this is: work moved into such a call (RoPE into attention) would leave the
    captured segment for the eager call, so a layer keeps it before the call, and the
    warm-up launches what its capture will."""
    return _capturing is not None or _warming_up


@contextlib.contextmanager
def warm_up_for(breaks: bool) -> Iterator[None]:
    """The eager warm-up of a capture with breaks (or without): breaking() answers as the
    capture's forward will."""
    global _warming_up
    previous, _warming_up = _warming_up, breaks
    try:
        yield
    finally:
        _warming_up = previous


def run_outside_graph(
    fn: Callable[..., None], *tensors: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Call fn(*tensors, out), which writes out in place; during a breakable capture, make it
    an eager step between two segments. `out` must be allocated before this call."""
    if _capturing is None:
        fn(*tensors, out)
    else:
        _capturing.add_break(fn, tensors, out)
    return out


def replay_memo() -> dict | None:
    """While a replay runs a break, that break's memo: a dict that lives as long as its graph.
    The break's call passes the same tensors at every replay, so it may keep there what it
    derives from them alone (an attention launch's bound arguments: a PIECEWISE decode step
    pays each break's host time). What also depends on the live batch must be checked before
    reuse. None outside a replay's breaks: an eager step's tensors are new every step."""
    return _replaying


def alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor viewing t's memory without keeping it allocated (vLLM's weak_ref_tensor)."""
    storage = t.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), t.device, storage.nbytes()
    )
    with torch.inference_mode(False):  # a normal tensor: replay may run in or out of inference
        view = torch.empty(0, dtype=t.dtype, device=t.device)
        return view.set_(weak, t.storage_offset(), t.shape, t.stride())


class BreakableGraph:
    """One captured forward pass: segments and the eager calls between them. Captured with
    breaks=False it is one plain CUDA graph in which run_outside_graph calls are captured like
    any other op (FULL graphs)."""

    def __init__(self, pool: tuple[int, int], stream: torch.cuda.Stream) -> None:
        self.pool, self.stream = pool, stream
        self.output: torch.Tensor | None = None
        self.num_breaks = 0
        self._steps: list[Callable[[], object]] = []  # segment replays and eager calls, in order
        self._segment: torch.cuda.CUDAGraph | None = None  # the segment being captured

    def capture(self, fn: Callable[[], torch.Tensor], breaks: bool = True) -> torch.Tensor:
        """Capture fn() on self.stream (not the current stream: capture needs a side stream).
        The caller makes sure no launch in fn compiles first (GraphRunner warms up where
        kernels.variants says a kernel variant is cold)."""
        global _capturing
        if _capturing is not None:
            raise RuntimeError("a breakable capture is already under way")
        with torch.cuda.stream(self.stream):
            self._begin_segment()
            _capturing = self if breaks else None
            try:
                self.output = fn()
            except BaseException:
                # end the capture and report the first error; a capture stopped at its first
                # launch (a cold kernel variant: GraphRunner warms up and captures again) ends
                # an empty segment, which torch warns of as if capture had gone wrong
                with contextlib.suppress(Exception), warnings.catch_warnings():
                    warnings.filterwarnings("ignore", "The CUDA Graph is empty")
                    self._end_segment()
                raise
            finally:
                _capturing = None
            self._end_segment()
        return self.output

    def add_break(
        self, fn: Callable[..., None], tensors: tuple[torch.Tensor, ...], out: torch.Tensor
    ) -> None:
        """Called by run_outside_graph during capture: end the segment, record, begin anew."""
        self._end_segment()
        self._steps.append(_Break(partial(fn, *map(alias, tensors), alias(out))))
        self.num_breaks += 1
        self._begin_segment()

    def replay(self) -> torch.Tensor:
        """Run on the current stream; inputs must already be in the captured buffers."""
        for step in self._steps:
            step()
        return self.output

    def _begin_segment(self) -> None:
        self._segment = torch.cuda.CUDAGraph()
        self._segment.capture_begin(pool=self.pool)

    def _end_segment(self) -> None:
        segment, self._segment = self._segment, None
        segment.capture_end()
        self._steps.append(segment.replay)


class _Break:
    """An eager call between two segments, run with its memo as replay_memo()."""

    __slots__ = ("call", "memo")

    def __init__(self, call: Callable[[], object]) -> None:
        self.call, self.memo = call, {}

    def __call__(self) -> None:
        global _replaying
        _replaying = self.memo
        try:
            self.call()
        finally:
            _replaying = None
