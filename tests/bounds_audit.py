"""An opt-in pytest plugin: every interpreted Triton load, store and atomic must address, in each
lane its mask keeps, memory inside one tensor argument of its launch (the tensor's own extent,
not merely its allocation). A lane outside fails the test that launched it, naming the kernel,
the access and the program. `pytest -p bounds_audit tests/test_gemv.py ...`

NaN-fenced inputs (helpers.nan_fenced) catch an out-of-bounds read only where its value reaches
the output; this sees the reads whose lanes are dropped later, the FP8 ones (the interpreter
reads FP8's NaN byte as a finite 480), and stores. It wraps the interpreter's internals
(triton.runtime.interpreter, Triton 3.9); a Triton that renames them fails at import."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton.runtime import interpreter

_ranges: list[tuple[int, int]] = []  # [first byte, end) of each tensor argument of the launch
_kernel = [""]
_violations: dict[tuple[str, str], list] = {}  # (kernel, access) -> [lanes, first program]

_init_args = interpreter.GridExecutor._init_args_hst
_Builder = interpreter.InterpreterBuilder
_load, _store = _Builder.create_masked_load, _Builder.create_masked_store
_rmw, _cas = _Builder.create_atomic_rmw, _Builder.create_atomic_cas


def _extent(t: torch.Tensor) -> tuple[int, int]:
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _launch_args(self, args_dev, kwargs):
    """The launch's host copies of its arguments, whose addresses the kernel computes from."""
    args, kwargs_hst = _init_args(self, args_dev, kwargs)
    tensors = [a for a in (*args, *kwargs_hst.values()) if isinstance(a, torch.Tensor)]
    _ranges[:] = [_extent(t) for t in tensors if t.numel()]
    _kernel[0] = self.fn.__name__
    return args, kwargs_hst


def _check(kind: str, ptrs, mask: np.ndarray) -> None:
    size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
    addresses = np.asarray(ptrs.data).astype(np.uint64)
    kept = addresses[np.broadcast_to(mask, addresses.shape).astype(bool)]
    inside = np.zeros(kept.shape, dtype=bool)
    for lo, hi in _ranges:
        inside |= (kept >= lo) & (kept + size <= hi)
    if not inside.all():
        seen = _violations.setdefault(
            (_kernel[0], kind), [0, interpreter.interpreter_builder.grid_idx]
        )
        seen[0] += int((~inside).sum())


def _masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
    _check("load", ptrs, mask.data)
    return _load(self, ptrs, mask, other, cache_policy, is_volatile)


def _masked_store(self, ptrs, value, mask, cache_policy):
    _check("store", ptrs, mask.data)
    return _store(self, ptrs, value, mask, cache_policy)


def _atomic_rmw(self, op, ptr, val, mask, sem, scope):
    _check("atomic", ptr, mask.data)
    return _rmw(self, op, ptr, val, mask, sem, scope)


def _atomic_cas(self, ptr, cmp, val, sem, scope):
    _check("atomic cas", ptr, np.ones(np.shape(ptr.data), dtype=bool))
    return _cas(self, ptr, cmp, val, sem, scope)


def pytest_configure(config) -> None:
    interpreter.GridExecutor._init_args_hst = _launch_args
    _Builder.create_masked_load, _Builder.create_masked_store = _masked_load, _masked_store
    _Builder.create_atomic_rmw, _Builder.create_atomic_cas = _atomic_rmw, _atomic_cas


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    _violations.clear()
    result = yield
    if _violations:
        shown = "\n".join(
            f"{kernel}: {kind}, {lanes} lanes outside every tensor argument (first: program "
            f"{program})"
            for (kernel, kind), (lanes, program) in _violations.items()
        )
        pytest.fail(f"out-of-bounds accesses:\n{shown}", pytrace=False)
    return result
