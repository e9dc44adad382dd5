"""RMSNorm over the last dimension, fused with the residual add when a residual is given."""

from __future__ import annotations

import torch
from torch import nn

from ostinato.kernels import fused_add_rms_norm, rms_norm
from ostinato.kernels.fp8 import SplitSum, settled


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor | SplitSum, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With it: residual += x; x = norm(residual), both in place
        (one kernel instead of three), returning (x, residual). A SplitSum x is settled first."""
        x = settled(x)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual

    def stream(
        self, hidden: torch.Tensor | SplitSum, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream (hidden + residual, or hidden alone) normalised, and the stream."""
        hidden = settled(hidden)
        if residual is None:
            return self(hidden), hidden
        return self(hidden, residual)
