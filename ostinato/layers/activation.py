"""SiLU-and-mul over the merged gate|up projection."""

from __future__ import annotations

import torch
from torch import nn

from ostinato.kernels import silu_and_mul
from ostinato.kernels.gemv import gemv, gemv_pays
from ostinato.layers.linear import Linear


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2 * d] = gate | up -> silu(gate) * up [..., d]."""
        return silu_and_mul(x)

    def of_projection(self, gate_up: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """silu_and_mul(gate_up(x)); one kernel for both where the small-batch projection
        kernel pays (a plain projection only: a wrapped one, e.g. with LoRA, adds to it)."""
        if isinstance(gate_up, Linear) and gemv_pays(x, gate_up.weight):
            return gemv(x, gate_up.weight, gate_up.bias, silu_and_mul=True)
        return self(gate_up(x))
