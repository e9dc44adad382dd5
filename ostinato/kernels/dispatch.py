"""Which implementation a kernel call takes, and a `jit` that honours TRITON_INTERPRET per call.

Triton reads TRITON_INTERPRET once, when `triton.jit` decorates, so a process would get one kind
for good, its own `tl.sum`, `tl.cdiv`, ... included. The CPU tests set the variable for the
kernel tests alone while the engine tests in the same process keep the torch path, so here the
choice is made at each launch.
"""

import functools
import math
import os
import sys
from contextlib import contextmanager

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from ostinato.kernels import variants

# os.environ's own dict (encoded keys and values), which every write through os.environ
# (monkeypatch.setenv included) updates: a get there is exact and costs a dict lookup, where
# os.environ.get encodes and decodes in Python (~1 µs, ~140 calls per eager decode step)
_ENVIRON = os.environ._data
_INTERPRET, _ON = os.environ.encodekey("TRITON_INTERPRET"), os.environ.encodevalue("1")


def interpreting() -> bool:
    return _ENVIRON.get(_INTERPRET) == _ON


PDL = True  # Hopper's programmatic dependent launch for our kernels (an A/B switch for benches)


def pdl_options() -> dict:
    """A kernel's PDL constexpr and launch option. With PDL the GPU may start a kernel while
    the one before it drains; every kernel waits for its predecessor (gdc_wait) before it
    touches memory. The interpreter has no such launch."""
    on = PDL and not interpreting() and _has_pdl()
    return {"PDL": on, "launch_pdl": on}


@functools.cache
def _has_pdl() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@functools.cache
def num_sms(device: torch.device, interpreted: int) -> int:
    """The device's SM count, which split launches size themselves by; on the CPU (the
    interpreter) `interpreted`, a small count chosen so CPU tests reach the split paths."""
    if device.type != "cuda":
        return interpreted
    return torch.cuda.get_device_properties(device).multi_processor_count


SPLIT_COUNTS = 1 << 16  # counts per device for split-K launches: output tiles of one launch
_split_counts: dict[tuple[torch.device, bool], torch.Tensor] = {}


def split_counts(device: torch.device, kernel: str, side: bool = False) -> torch.Tensor:
    """int32 [SPLIT_COUNTS] on this device, zero between launches: a split-K launch counts the
    programs of each output tile that have stored their partial, and the last resets the
    count. Kernels on one stream run one after another, so every split kernel of the step's
    stream shares them; `side`: a second set, for split kernels on a side stream (LoRA's
    shrink), which may run beside one of those. Allocated once, at a first call outside graph
    capture: a capture would record the zeroing, not run it."""
    counts = _split_counts.get((device, side))
    if counts is None:
        _outside_capture(device, f"{kernel}: a split launch must run once before capture")
        counts = torch.zeros(SPLIT_COUNTS, dtype=torch.int32, device=device)
        _split_counts[(device, side)] = counts
    return counts


_deferred_parts: dict[torch.device, list[torch.Tensor]] = {}


def deferred_parts(device: torch.device, shape: tuple[int, ...], kernel: str) -> torch.Tensor:
    """float32 `shape` on this device for the partials of a split-K launch whose reader sums
    them (fp8.SplitSum: the next kernel, before any later launch defers). One buffer a
    device, outside every graph's memory pool: partials kept from the pool until the next
    norm moved every later-captured graph's tensors by 32 MiB, and the 8-row step, which
    defers nothing, ran 2.3% slower (H200, FP8 llama-3.1-8b, benchmarks/h200-2026-11-28-s41.md
    and -s42.md; 1.5% faster with this buffer, -s43.md). Grown only outside capture, as
    split_counts are made; a grown buffer keeps the one before alive for the graphs that
    captured it."""
    held = _deferred_parts.setdefault(device, [])
    numel = math.prod(shape)
    if not held or held[-1].numel() < numel:
        _outside_capture(device, f"{kernel}: a deferred split must run once before capture")
        held.append(torch.empty(numel, dtype=torch.float32, device=device))
    return held[-1][:numel].view(shape)


def _outside_capture(device: torch.device, cold: str) -> None:
    """Raise variants.ColdKernel(cold) under a CUDA graph capture on device: what is about to
    be allocated must be made at a warm-up, which runs before its capture."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise variants.ColdKernel(cold)


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or interpreting()


class _Interpreted(InterpretedFunction):
    def __call__(self, *args, **kwargs):
        """A call from inside an interpreted kernel. The launch already patched triton.language
        for the interpreter; patching again on every call, as Triton does, triples the time."""
        return self.rewrite()(*args, **kwargs)


class Kernel(JITFunction):
    """A jitted function that runs compiled or interpreted, chosen at each launch. It stays a
    JITFunction so the compiler inlines it where another kernel calls it."""

    def __init__(self, fn, **options) -> None:
        super().__init__(fn, **options)
        self.interpreted = _Interpreted(fn, **options)

    def run(self, *args, grid, warmup, **kwargs):
        if variants.mode is not None:  # graph capture's guard (kernels/variants.py)
            variants.note_launch(self, args, kwargs)
        if not interpreting():
            return super().run(*args, grid=grid, warmup=warmup, **kwargs)
        with _interpreted_language():
            return self.interpreted.run(*args, grid=grid, warmup=warmup, **kwargs)

    def __call__(self, *args, **kwargs):
        if interpreting():
            return self.interpreted(*args, **kwargs)
        return super().__call__(*args, **kwargs)  # raises: compiled kernels inline instead


def jit(fn=None, **options):
    """Like `triton.jit`, bare or with its options (e.g. do_not_specialize)."""
    if fn is None:
        return lambda fn: Kernel(fn, **options)
    return Kernel(fn, **options)


@functools.cache
def _language_functions() -> list[tuple[object, str, JITFunction, InterpretedFunction]]:
    """triton.language's own jitted functions (tl.sum, tl.max, tl.cdiv, ...), compiled kind."""
    return [
        (module, name, value, InterpretedFunction(value.fn))
        for module_name, module in list(sys.modules.items())
        if module_name.startswith("triton.language")
        for name, value in vars(module).items()
        if type(value) is JITFunction
    ]


@contextmanager
def _interpreted_language():
    """Swaps triton.language's jitted functions for interpreted ones, as they would have been
    had TRITON_INTERPRET been set when triton was imported."""
    functions = _language_functions()
    for module, name, _, interpreted in functions:
        setattr(module, name, interpreted)
    try:
        yield
    finally:
        for module, name, compiled, _ in functions:
            setattr(module, name, compiled)
