"""What a model's weights weigh, and how much of them one decode step reads: every dense weight
at its stored width (FP8: one byte, plus its scales), and of each mixture-of-experts layer only
the experts the step's tokens choose. Shapes only (a model on the meta device)."""

from __future__ import annotations

import torch
from torch import nn

from ostinato.layers.moe import FusedMoE
from ostinato.loader import build_model, finish_loading
from ostinato.quantization import QuantSpec


def meta_model(hf_config, dtype: torch.dtype, quantization: QuantSpec | None) -> nn.Module:
    """The whole model as it runs (FP8 at load applied), shapes only."""
    model = build_model(hf_config, "meta", dtype, None, quantization)
    finish_loading(model)
    return model


def active_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts `tokens` tokens choose, expected under uniform routing."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def step_weight_bytes(model: nn.Module, tokens: int | None = None) -> int:
    """Weight bytes a step of `tokens` tokens reads (None: all of them, every expert)."""
    total, seen = 0.0, set()
    for module in model.modules():
        share = 1.0
        if isinstance(module, FusedMoE) and tokens is not None:
            experts = module.w13.shape[0]
            share = active_experts(experts, module.top_k, tokens) / experts
        for p in module.parameters(recurse=False):
            if id(p) not in seen:  # a tied weight once
                seen.add(id(p))
                total += p.numel() * p.element_size() * share
    return int(total)


def describe(hf_config, dtype: torch.dtype, quantization: QuantSpec | None) -> dict:
    """For `explain`: the quantisation, the MoE shape, and the weight bytes a decode step reads
    at batch 1 and 32 (the whole model, every stage and tensor rank together)."""
    model = meta_model(hf_config, dtype, quantization)
    blocks = [m for m in model.modules() if isinstance(m, FusedMoE)]
    report: dict = {"quantization": None, "moe": None}
    if quantization is not None:
        report["quantization"] = {
            "method": quantization.method,
            "weights": "float8_e4m3fn",
            "scales": (f"one per {quantization.block[0]}x{quantization.block[1]} block "
                       "(checkpoint)" if quantization.block else "one per output row (at load)"),
        }  # fmt: skip
    if blocks:
        report["moe"] = {
            "experts": blocks[0].w13.shape[0],
            "active_experts_per_token": blocks[0].top_k,
            "expert_intermediate_size": blocks[0].full_inter,
            "sparse_layers": len(blocks),
        }
    report["weight_bytes"] = step_weight_bytes(model)
    report["decode_step_weight_bytes"] = {
        f"batch_{b}": step_weight_bytes(model, b) for b in (1, 32)
    }
    return report
