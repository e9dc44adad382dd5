"""How a checkpoint tensor goes into a parameter, or into a tensor rank's share of one.

Every parameter may carry `weight_loader(param, loaded, shard=None)` (shard: which part of a
merged parameter, e.g. k of q|k|v) and `full_shape` (its shape with one tensor rank: random
weights are drawn at that shape, then loaded like a checkpoint tensor). `loaded` is a torch
tensor or a lazy checkpoint tensor (loader.LazyTensor): both have `.shape`, and indexing the
lazy one reads only the rows or columns asked for, so a rank never reads what it does not hold.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class Loadable(Protocol):
    """A torch.Tensor, or a checkpoint tensor that is read when indexed."""

    @property
    def shape(self) -> torch.Size: ...

    def __getitem__(self, index) -> torch.Tensor: ...


def check_shape(loaded: Loadable, shape: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != tuple(shape):
        raise ValueError(
            f"shape mismatch: parameter {tuple(shape)}, checkpoint {tuple(loaded.shape)}"
        )


def read(loaded: Loadable) -> torch.Tensor:
    """All of it (a torch tensor as it is)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def load_whole(param: nn.Parameter, loaded: Loadable, shard: int | None = None) -> None:
    """The default loader: every rank holds the whole tensor (norms, biases of row-parallel
    projections), which must match the parameter's shape exactly."""
    check_shape(loaded, param.shape)
    param.data.copy_(read(loaded))


def loader_of(param: nn.Parameter):
    return getattr(param, "weight_loader", load_whole)


def full_shape(param: nn.Parameter) -> tuple[int, ...]:
    return tuple(getattr(param, "full_shape", param.shape))
