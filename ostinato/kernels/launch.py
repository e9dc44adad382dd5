"""Launching a compiled Triton kernel without Triton's per-call Python work.

`kernel[grid](*args)` binds, specialises and hashes every argument in Python on every call:
tens of µs on the GPU machine's CPU, several times the kernel itself at decode sizes, paid
once per layer by every eager attention call. A Launch fixes everything but the leading
tensor arguments (those that change from layer to layer), and calls the compiled kernel's
launcher with the argument list Triton itself would pass (every parameter in order,
constexprs included; the same in Triton 3.6 and 3.9). The first launch of each compiled
variant goes through Triton, and through kernels/variants.py's capture guard with it; later
ones cannot compile. In Triton 3.6 the launcher's own Python (`CudaLauncher.__call__`: two
scratch allocations, none for a kernel that asks for no scratch) is skipped too: its C
launch is called directly (_launcher).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache, partial, reduce
from operator import attrgetter, or_

import torch
import triton

from ostinato.kernels.dispatch import Kernel, interpreting

_current_stream = torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else None
_data_ptr, _dtype = torch.Tensor.data_ptr, attrgetter("dtype")  # C callables for map

# (kernel, the tail's specialisation, constexprs, options) -> a number
_fixed_keys: dict[tuple, int] = {}
# (that number, device, the head's specialisation) -> what launches the compiled kernel
_compiled: dict[tuple, tuple] = {}


class Launch:
    """kernel[grid](*head, *tail, **constexprs, **options), with head given per call.

    Triton compiles one kernel per specialisation of the arguments (integers equal to 1 or
    divisible by 16, pointers aligned to 16 bytes, dtypes, widths). The key here holds the same
    properties, the tail's computed once, so a compiled kernel is only ever launched for
    arguments Triton would have given it; the first call of each key goes through Triton."""

    def __init__(
        self,
        kernel: Kernel,
        grid: tuple[int, int, int],
        num_head: int,
        tail: tuple,
        constexprs: dict,
        **options,
    ) -> None:
        names = [p.name for p in kernel.params]
        if names[num_head + len(tail) :] != list(constexprs):
            raise ValueError(f"{kernel.fn.__name__}: constexprs must be the last parameters")
        self.kernel, self.grid = kernel, grid
        self.tail, self.kwargs = tail, {**constexprs, **options}  # tail holds its tensors alive
        # what follows head in Triton's argument list; pointers as integers, which the launcher
        # takes as they are (a tensor costs it a method call and a driver query)
        self.rest = (*(_address(a) for a in tail), *constexprs.values())
        self.direct = not interpreting()
        fixed = (id(kernel), *map(_specialisation, tail), *constexprs.items(), *options.items())
        self.key = _fixed_keys.setdefault(fixed, len(_fixed_keys))  # a small int hashes fast

    def __call__(self, *head: torch.Tensor) -> None:
        self.run(self.grid, *head)

    def run(self, grid: tuple[int, int, int], *head: torch.Tensor) -> None:
        """One launch on another grid: kernels whose program count follows the token count
        keep one Launch for every step size (the grid is no part of what Triton compiles)."""
        if not self.direct:
            self.kernel[grid](*head, *self.tail, **self.kwargs)
            return
        pointers, device, key = self._key(head)
        compiled = _compiled.get(key)
        if compiled is None:
            _compiled[key] = _launcher(self.kernel[grid](*head, *self.tail, **self.kwargs))
            return
        launcher, between = compiled
        launcher(*grid, _current_stream(device), *between, *pointers, *self.rest)

    def bind(self, *head: torch.Tensor) -> Callable[[], None] | None:
        """This launch of these head tensors as a call without arguments, for a caller that
        passes the same tensors every time: every argument but the stream found once. None
        until the kernel's variant for them has been compiled (by a first run). The call holds
        no tensor: its caller keeps this Launch (its tail) and the head alive while it uses it."""
        if not self.direct:
            return partial(self.run, self.grid, *head)
        pointers, device, key = self._key(head)
        compiled = _compiled.get(key)
        if compiled is None:
            return None
        launcher, between = compiled
        grid, args = self.grid, (*between, *pointers, *self.rest)
        return lambda: launcher(*grid, _current_stream(device), *args)

    def _key(self, head: tuple[torch.Tensor, ...]) -> tuple[list[int], int, tuple]:
        """(the head's pointers, its device, the key of the compiled kernel for it)"""
        pointers = [*map(_data_ptr, head)]
        device = head[0].get_device()
        # what Triton specialises on in the head: 16-byte alignment (True when every pointer
        # is aligned, found by one C-level OR; else each pointer's) and the dtypes
        aligned = not reduce(or_, pointers) & 15 or tuple([p % 16 == 0 for p in pointers])
        return pointers, device, (self.key, device, aligned, *map(_dtype, head))


def _launcher(kernel) -> tuple:
    """(what launches a compiled kernel, its arguments between the stream and the kernel's
    own). No launch metadata and no enter/exit hooks: a profiler's hooks see first calls only.
    Where the launcher is Triton 3.6's and the kernel needs no scratch memory, its C launch
    with the arguments `CudaLauncher.__call__` would add (about 1 µs a launch less on the GPU
    machine's host); otherwise the launcher itself."""
    run = kernel.run
    if _passes_through(type(run)) and not (run.global_scratch_size or run.profile_scratch_size):
        flags = (run.launch_cooperative_grid, run.launch_pdl)
        return run.launch, (kernel.function, *flags, None, None, kernel.packed_metadata,
                            None, None, None)  # fmt: skip
    return run, (kernel.function, kernel.packed_metadata, None, None, None)


# Triton versions whose CudaLauncher.__call__, with these parameters, allocates scratch and then
# calls self.launch(gridX, gridY, gridZ, stream, function, cooperative, pdl, global_scratch,
# profile_scratch, *args), and does nothing else
_PASS_THROUGH_VERSIONS = ("3.6.",)
_PASS_THROUGH_PARAMETERS = ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]


@cache
def _passes_through(launcher_type: type) -> bool:
    if not triton.__version__.startswith(_PASS_THROUGH_VERSIONS):
        return False
    return list(inspect.signature(launcher_type.__call__).parameters) == _PASS_THROUGH_PARAMETERS


def _address(arg):
    return arg.data_ptr() if isinstance(arg, torch.Tensor) else arg


def _specialisation(arg) -> tuple:
    """What Triton's compiled kernel depends on, for one non-constexpr argument."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool) or not isinstance(arg, int):
        return (type(arg),)
    return (int, arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31, arg >= 2**63)
