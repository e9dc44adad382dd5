"""A rank's side of LoRA: its projections wrapped with slots, and adapters copied into them."""

from __future__ import annotations

import torch
from torch import nn

from ostinato.loader import plain_attributes
from ostinato.lora.adapter import TARGETS, adapter_weights
from ostinato.lora.layer import LoRALinear


class LoRAModel:
    """Wraps every supported projection of `model` (this rank's layers only) in a LoRALinear
    with max_loras slots, and loads adapters into slots as steps ask for them."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        self.layer_range = range(*model.layer_range)
        self.layers: dict[str, LoRALinear] = {}
        for name, module in list(model.named_modules()):
            parent, _, leaf = name.rpartition(".")
            if leaf in TARGETS and not isinstance(module, LoRALinear):
                wrapped = LoRALinear(module, max_loras, max_rank)
                setattr(model.get_submodule(parent), leaf, wrapped)
                self.layers[name] = wrapped
        plain_attributes(model)  # the wrapped projections are read as plain attributes too
        self.dtype = next(iter(self.layers.values())).lora_a.dtype

    @torch.no_grad()
    def load(self, slot: int, path: str) -> None:
        """Replace whatever slot held by the adapter at `path` (checked on the driver)."""
        for layer in self.layers.values():
            layer.clear_slot(slot)
        for module, shard, a, b in adapter_weights(path, self.layer_range, self.dtype):
            self.layers[module].set_shard(slot, shard, a, b)
