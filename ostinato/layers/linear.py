"""Linear layers, including merged projections (q|k|v and gate|up) that run as one matmul.

Merging saves kernel launches, which is what a decode step is bound by. Checkpoints store the
parts separately, so merged parameters carry a `weight_loader` that fills one shard of rows.
Parameters are created uninitialised: the loader fills every one of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ostinato.kernels.gemv import gemv, gemv_pays


def copy_weight(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """The default loader: the checkpoint tensor must match the parameter's shape exactly."""
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if gemv_pays(x, self.weight):
            return gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dimension.

    Shard i owns rows [offsets[i], offsets[i + 1]); `weight_loader(param, tensor, i)` copies a
    checkpoint's separate projection (weight or bias) into it.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(out_sizes), bias)
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes) + 1)]
        for param in self.parameters():
            param.weight_loader = self.load_shard
            param.num_shards = len(out_sizes)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        copy_weight(param.data[self.offsets[shard] : self.offsets[shard + 1]], loaded)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(self.out_sizes, dim=-1)
