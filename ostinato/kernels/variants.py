"""Which compiled variants of our Triton kernels have launched, so graph capture never compiles.

Triton compiles a kernel once per variant: the values of its constexpr arguments and launch
options, each tensor's dtype and 16-byte alignment, and of each integer whether it is 1, a
multiple of 16 and within 32 bits. A launch of a new variant compiles and loads a module first,
which must not happen inside a CUDA graph capture. The graph runtime therefore records the
variants its eager warm-ups launch (`recording()`) and captures under `warm_only()`, where the
launch of a variant no warm-up launched raises ColdKernel before Triton sees it; the runtime
then warms up and captures again. So a warm-up runs once per set of kernel variants, not once
per graph size. The key below is at least as fine as Triton's own, so a recorded key names a
compiled variant. Every launch of a `dispatch.jit` kernel passes through `note_launch`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

RECORD, CHECK = "record", "check"
mode: str | None = None  # RECORD, CHECK, or None: off, a launch pays one comparison
_launched: set[tuple] = set()
_constexprs: dict[object, frozenset[str]] = {}  # per kernel, its constexpr parameters


class ColdKernel(RuntimeError):
    """Inside warm_only(): a launch of a kernel variant that no recorded warm-up launched."""


@contextmanager
def _watching(new_mode: str) -> Iterator[None]:
    global mode
    previous, mode = mode, new_mode
    try:
        yield
    finally:
        mode = previous


def recording() -> AbstractContextManager[None]:
    """Launches inside count as warm: their variants are compiled once they return."""
    return _watching(RECORD)


def warm_only() -> AbstractContextManager[None]:
    """Launches inside must be of recorded variants, else ColdKernel is raised before them."""
    return _watching(CHECK)


def note_launch(kernel, args: tuple, kwargs: dict) -> None:
    """Called by every launch while `mode` is set."""
    key = launch_key(kernel, args, kwargs)
    if mode == RECORD:
        _launched.add(key)
    elif key not in _launched:
        raise ColdKernel(f"{kernel.__name__}: a variant no warm-up launched")


def launch_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """The kernel and, per argument, what Triton may specialise on (a superset of it)."""
    constexpr = _constexpr_params(kernel)
    positional = tuple(
        _spec(name in constexpr, a) for name, a in zip(kernel.arg_names, args, strict=False)
    )
    # keyword arguments are constexprs or launch options (num_warps, ...) unless named params
    keyword = tuple(
        (name, _spec(name in constexpr or name not in kernel.arg_names, value))
        for name, value in sorted(kwargs.items())
    )
    return kernel, positional, keyword


def _constexpr_params(kernel) -> frozenset[str]:
    names = _constexprs.get(kernel)
    if names is None:
        names = _constexprs[kernel] = frozenset(p.name for p in kernel.params if p.is_constexpr)
    return names


def _spec(is_constexpr: bool, value) -> object:
    if is_constexpr:
        return value
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value == 1, value % 16 == 0, -(2**31) <= value < 2**31
    if isinstance(value, float):
        return float
    return value
