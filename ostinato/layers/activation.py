"""SiLU-and-mul over the merged gate|up projection."""

from __future__ import annotations

import torch
from torch import nn

from ostinato.kernels import silu_and_mul


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2 * d] = gate | up -> silu(gate) * up [..., d]."""
        return silu_and_mul(x)
