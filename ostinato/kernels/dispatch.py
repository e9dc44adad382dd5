"""Which implementation a kernel call takes."""

import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
