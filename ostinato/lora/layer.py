"""A base projection plus adapter slots: y = base(x) + the adapter term of each token's slot."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ostinato.context import get_forward_context
from ostinato.kernels.lora import lora_expand, lora_shrink


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

    def plan(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Callable | None:
        """Linear.plan's for the fused paths (layers/linear.py), asked with its arguments: the
        base's own plan in a step without adapters, so such a step runs as the model without
        LoRA does; else None (forward: the base projection, the shrink beside it, the expand)."""
        if get_forward_context().lora is not None:
            return None
        return self.base.plan(x, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context().lora
        if meta is None:  # no adapter in this step: the base projection alone
            return self.base(x)
        if x.is_cuda:
            # the shrink on a side stream beside the base projection, which reads the same x:
            # its latency hides behind the projection's (a fork and a join in a captured graph)
            main = torch.cuda.current_stream(x.device)
            side = _side_stream(x.device)
            side.wait_stream(main)
            try:
                with torch.cuda.stream(side):
                    partials = lora_shrink(x, self.lora_a, self.lora_ranks, meta)
                y = self.base(x)
            finally:  # joined even where a launch raises: a capture ends only with it joined
                main.wait_stream(side)
        else:
            y = self.base(x)
            partials = lora_shrink(x, self.lora_a, self.lora_ranks, meta)
        lora_expand(partials, self.lora_b, self.lora_ranks, self.offsets, y, meta)
        return y

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
