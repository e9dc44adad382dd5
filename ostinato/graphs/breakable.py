"""Breakable capture: PIECEWISE graphs with eager calls between captured segments.

Placeholder seam: outside a breakable capture `run_outside_graph` just calls fn.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def run_outside_graph(fn: Callable[..., None], *tensors: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    fn(*tensors, out)
    return out
