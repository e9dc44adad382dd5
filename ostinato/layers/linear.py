"""Linear layers: merged projections (q|k|v and gate|up run as one matmul) and their split over
tensor-parallel ranks.

Merging saves kernel launches, which is what a decode step is bound by. With T tensor ranks
(layout.py), a column-parallel projection holds 1/T of each merged part's output
rows, in whole heads, and a row-parallel one 1/T of its input columns: the attention and the
MLP between them run on this rank's heads and features alone, and one all-reduce per block
sums the partial outputs. With T = 1 both are the plain projection: the same kernels (the
small-batch kernel included), no collective.

Parameters are created uninitialised: the loader fills every one (see layers/weights.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ostinato.distributed.parallel import tp_group
from ostinato.kernels import silu_and_mul
from ostinato.kernels.gemv import gemv, gemv_normed, gemv_pays
from ostinato.layers.norm import RMSNorm
from ostinato.layers.weights import Loadable, check_shape
from ostinato.layout import rank_share

FUSE = True  # the small-batch fusions around the projections (an A/B switch for benches)


def project(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias): the small-batch kernel where it pays, else cuBLAS."""
    if gemv_pays(x, weight):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def normed_projection(
    proj: nn.Module,
    norm: RMSNorm,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    silu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """proj(norm(x + residual)), with silu (a merged gate|up) SiLU-and-mul after it, and the
    residual stream x + residual as one tensor (x itself without a residual). One kernel
    where the small-batch kernel pays for a plain projection (the norm in its prologue); else
    the norm (with the add, in place) and then proj, which may be a wrapped one (LoRA)."""
    if isinstance(proj, Linear) and proj.fuses(x):
        return gemv_normed(x, residual, norm.weight, norm.eps, proj.weight, proj.bias, silu)
    if residual is None:
        residual, x = x, norm(x)
    else:
        x, residual = norm(x, residual)
    y = proj(x)
    return (silu_and_mul(y) if silu else y), residual


def residual_projection(
    proj: nn.Module, x: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual stream once proj(x) is added to it, as (hidden, residual): hidden +
    residual, or hidden alone when residual is None. The small-batch kernel adds in its
    epilogue, so the next norm reads one tensor; otherwise the add is left to that norm."""
    if isinstance(proj, Linear) and proj.fuses(x):
        return gemv(x, proj.weight, proj.bias, add=residual), None
    return proj(x), residual


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias)

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether the small-batch kernel runs this projection of x, with the ops around it."""
        return FUSE and gemv_pays(x, self.weight)


class ColumnParallelLinear(Linear):
    """Projections of the same input stacked along the output dimension, each split over the
    tensor ranks in whole units (units[i] rows: a head's head_dim; default 1).

    Part i has full_sizes[i] rows in the checkpoint; this rank holds rows[i] of them (a part
    with fewer units than ranks is shared, as KV heads are: see rank_share), out_sizes[i] rows
    at offsets[i] here. `weight_loader(param, tensor, i)` fills part i from the checkpoint's
    separate projection (weight or bias); shard None: from the whole merged tensor.
    """

    def __init__(
        self,
        in_features: int,
        full_sizes: list[int],
        bias: bool = False,
        units: list[int] | None = None,
    ) -> None:
        tp = tp_group()
        rows = []
        for size, unit in zip(full_sizes, units or [1] * len(full_sizes), strict=True):
            share = rank_share(size // unit, tp.rank, tp.size)
            rows.append(slice(share.start * unit, share.stop * unit))
        out_sizes = [r.stop - r.start for r in rows]
        super().__init__(in_features, sum(out_sizes), bias)
        self.rows, self.out_sizes, self.full_sizes = rows, out_sizes, list(full_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes) + 1)]
        self.full_offsets = [sum(full_sizes[:i]) for i in range(len(full_sizes) + 1)]
        for param in self.parameters():
            param.weight_loader = self.load
            param.num_shards = len(out_sizes)
            param.full_shape = (self.full_offsets[-1], *param.shape[1:])

    def load(self, param: nn.Parameter, loaded: Loadable, shard: int | None = None) -> None:
        if shard is None:
            check_shape(loaded, param.full_shape)
            for i in range(len(self.full_sizes)):
                self.load(param, loaded[self.full_offsets[i] : self.full_offsets[i + 1]], i)
            return
        check_shape(loaded, (self.full_sizes[shard], *param.shape[1:]))
        here = param.data[self.offsets[shard] : self.offsets[shard + 1]]
        here.copy_(loaded[self.rows[shard]])

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(self.out_sizes, dim=-1)


class RowParallelLinear(Linear):
    """A projection whose input features (the heads or intermediate features a column-parallel
    projection left on this rank) are split over the tensor ranks: each rank multiplies its
    columns, one all-reduce sums the partial outputs, then the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = tp_group()
        if in_features % tp.size:
            raise ValueError(
                f"{in_features} input features cannot be split evenly over {tp.size} tensor "
                "ranks: choose a tensor_parallel_size that divides them"
            )
        share = rank_share(in_features, tp.rank, tp.size)
        super().__init__(len(share), out_features, bias)
        self.tp, self.cols = tp, slice(share.start, share.stop)
        self.weight.weight_loader = self.load
        self.weight.full_shape = (out_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return project(x, self.weight, self.bias)
        out = self.tp.all_reduce(project(x, self.weight))
        return out if self.bias is None else out.add_(self.bias)

    def fuses(self, x: torch.Tensor) -> bool:
        """Not over several ranks: the residual is added after the all-reduce."""
        return self.tp.size == 1 and super().fuses(x)

    def load(self, param: nn.Parameter, loaded: Loadable, shard: int | None = None) -> None:
        check_shape(loaded, param.full_shape)
        param.data.copy_(loaded[:, self.cols])
