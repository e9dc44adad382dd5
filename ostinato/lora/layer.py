"""A base projection plus adapter slots: y = base(x) + the adapter term of each token's slot."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from ostinato.context import get_forward_context
from ostinato.kernels.lora import lora_expand, lora_expand_silu, lora_shrink
from ostinato.layers.norm import RMSNorm


class LoRALinear(nn.Module):
    """Wraps a Linear (merged ones have shards: q|k|v, gate|up) with `num_slots` fixed slots.

    Slot buffers are allocated once, so captured graphs keep reading the same addresses while
    adapters are copied in and out of them. A slot's shard s holds A in rows
    [s * max_rank, s * max_rank + rank) of `lora_a` and scaling * B in columns [0, rank) of
    `lora_b`'s rows of that shard; everything else stays zero.
    """

    def __init__(self, base: nn.Module, num_slots: int, max_rank: int) -> None:
        super().__init__()
        self.base = base
        out_features, in_features = base.weight.shape
        sizes = getattr(base, "out_sizes", [out_features])
        self.offsets = tuple(sum(sizes[:i]) for i in range(len(sizes) + 1))
        self.max_rank = max_rank
        like = {"dtype": base.weight.dtype, "device": base.weight.device}
        shards = len(sizes)
        self.register_buffer(
            "lora_a", torch.zeros(num_slots, shards * max_rank, in_features, **like)
        )
        self.register_buffer("lora_b", torch.zeros(num_slots, out_features, max_rank, **like))
        self.register_buffer(
            "lora_ranks", torch.zeros(num_slots, shards, dtype=torch.int32, device=like["device"])
        )

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def plan(
        self,
        x: torch.Tensor,
        norm: RMSNorm | None = None,
        residual: torch.Tensor | None = None,
        silu: bool = False,
        add: torch.Tensor | None = None,
    ) -> Callable | None:
        """Linear.plan's for the fused paths (layers/linear.py). In a step without adapters the
        base's own plan, so such a step runs as the model without LoRA does. With adapters, at
        one row (every token then has one), the base's plan without SiLU, the shrink beside it
        on the input before its norm (with the norm weight; it keeps the mean squares, and the
        expand applies the 1/rms: the norm is one scale a token), then the expand, with
        SiLU-and-mul where silu (_adapted): no norm or SiLU kernel, the residual added in the
        base's epilogue. Else None (forward: the base projection, the shrink beside it, the
        expand)."""
        if get_forward_context().lora is None:
            return self.base.plan(x, norm, residual, silu, add)
        if x.shape[0] != 1:
            return None
        base = self.base.plan(x, norm, residual, False, add)
        if base is None:
            return None
        return partial(self._adapted, base, None if norm is None else norm.eps, silu)

    def _adapted(self, base, eps, silu, x, weight, bias, residual, norm_weight, add):
        """A plan's call (-> (y, stream)) in a step with adapters: see plan."""
        meta = get_forward_context().lora
        norm = None if eps is None else (residual, norm_weight, eps)
        partials, (y, stream) = self._beside(
            x,
            lambda: lora_shrink(x, self.lora_a, self.lora_ranks, meta, norm),
            lambda: base(x, weight, bias, residual, norm_weight, add),
        )
        args = (partials, self.lora_b, self.lora_ranks, self.offsets, y, meta, eps)
        if silu:
            return lora_expand_silu(*args), stream
        lora_expand(*args)
        return y, stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context().lora
        if meta is None:  # no adapter in this step: the base projection alone
            return self.base(x)
        partials, y = self._beside(
            x, lambda: lora_shrink(x, self.lora_a, self.lora_ranks, meta), lambda: self.base(x)
        )
        lora_expand(partials, self.lora_b, self.lora_ranks, self.offsets, y, meta)
        return y

    @staticmethod
    def _beside(x: torch.Tensor, shrink: Callable, project: Callable) -> tuple[Any, Any]:
        """(shrink(), project()): on the GPU the shrink on a side stream beside the base
        projection, which reads the same x, so its latency hides behind the projection's (a
        fork and a join in a captured graph)."""
        if not x.is_cuda:
            return shrink(), project()
        main = torch.cuda.current_stream(x.device)
        side = _side_stream(x.device)
        side.wait_stream(main)
        try:
            with torch.cuda.stream(side):
                partials = shrink()
            return partials, project()
        finally:  # joined even where a launch raises: a capture ends only with it joined
            main.wait_stream(side)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.lora_ranks[slot].zero_()

    def set_shard(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """a [rank, in], b [out of this shard, rank] (scaling folded in) into a cleared slot."""
        rank = a.shape[0]
        row = shard * self.max_rank
        self.lora_a[slot, row : row + rank].copy_(a)
        self.lora_b[slot, self.offsets[shard] : self.offsets[shard + 1], :rank].copy_(b)
        self.lora_ranks[slot, shard] = rank


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One per device, shared by every LoRA layer: each joins it back before its expand."""
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream
