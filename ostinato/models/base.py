"""What passes between pipeline stages."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class IntermediateTensors:
    """A stage's output before its next layer's residual add: the next stage computes
    residual + hidden_states first. Both [num_tokens, hidden_size]."""

    hidden_states: torch.Tensor
    residual: torch.Tensor
