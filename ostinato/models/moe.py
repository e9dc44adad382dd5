"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral. Llama's attention and norms; the MLP of
a sparse layer is a router and experts (layers/moe.py).

Checkpoint names: each expert is separate (`experts.<e>.gate_proj/up_proj/down_proj`, Mixtral's
`block_sparse_moe.experts.<e>.w1/w3/w2`); here each layer's experts are stacked into
`mlp.experts.w13` (shard 2e: expert e's gate, 2e + 1: its up) and `mlp.experts.w2` (shard e).
"""

from __future__ import annotations

import re

from torch import nn

from ostinato.layers.moe import SparseMoeBlock
from ostinato.models.llama import LlamaForCausalLM, checkpoint_name, merged_name
from ostinato.models.qwen import Qwen3ForCausalLM

_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"\.experts\.(w13|w2)$")
_PARTS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}


def expert_param_name(name: str) -> tuple[str, int | None]:
    """`...mlp.experts.<e>.<proj>.weight` -> (`...mlp.experts.w13|w2`, shard); others as the
    dense model names them."""
    m = _EXPERT.search(name)
    if m is None:
        return merged_name(name)
    expert, (stacked, part) = int(m[1]), _PARTS[m[2]]
    shard = 2 * expert + part if stacked == "w13" else expert
    return f"{name[: m.start()]}.experts.{stacked}", shard


def expert_checkpoint_name(name: str, shard: int | None) -> str:
    m = _STACKED.search(name)
    if m is None:
        return checkpoint_name(name, shard)
    if m[1] == "w13":
        expert, proj = shard // 2, ("gate_proj", "up_proj")[shard % 2]
    else:
        expert, proj = shard, "down_proj"
    return f"{name[: m.start()]}.experts.{expert}.{proj}.weight"


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def make_mlp(config, layer_idx: int) -> nn.Module:
        sparse = (
            layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0
            and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0
        )
        if not sparse:
            return LlamaForCausalLM.make_mlp(config, layer_idx)
        return SparseMoeBlock(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            renormalize=config.norm_topk_prob,
        )

    param_name = staticmethod(expert_param_name)
    checkpoint_name = staticmethod(expert_checkpoint_name)


_MIXTRAL = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.",
            ".w2.": ".down_proj."}  # fmt: skip


class MixtralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def make_mlp(config, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            renormalize=True,
        )

    @staticmethod
    def param_name(name: str) -> tuple[str, int | None]:
        if ".block_sparse_moe." in name:
            for theirs, ours in _MIXTRAL.items():
                name = name.replace(theirs, ours)
        return expert_param_name(name)

    @staticmethod
    def checkpoint_name(name: str, shard: int | None) -> str:
        name = expert_checkpoint_name(name, shard)
        if ".mlp." not in name:
            return name
        for theirs, ours in _MIXTRAL.items():
            name = name.replace(ours, theirs)
        return name
