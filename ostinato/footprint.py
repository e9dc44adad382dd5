"""What a model's weights weigh, and how much of them one decode step reads: every dense weight
at its stored width (FP8: one byte, plus its scales), of each mixture-of-experts layer only
the experts the step's tokens choose, and of the token embedding only their rows. Shapes only
(a model on the meta device)."""

from __future__ import annotations

import torch
from torch import nn

from ostinato.layers.embedding import VocabEmbedding
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
    """Weight bytes a step of `tokens` tokens reads (None: all of them, every expert). A tied
    weight counts once, at the largest share any of its modules reads."""
    shares: dict[int, tuple[nn.Parameter, float]] = {}
    for module in model.modules():
        share = 1.0 if tokens is None else _share_read(module, tokens)
        for p in module.parameters(recurse=False):
            shares[id(p)] = (p, max(share, shares.get(id(p), (p, 0.0))[1]))
    return int(sum(p.numel() * p.element_size() * share for p, share in shares.values()))


def _share_read(module: nn.Module, tokens: int) -> float:
    """The share of module's own weights a step of `tokens` tokens reads: of a mixture of
    experts the experts its tokens choose, of a token embedding (not the LM head, which reads
    its every row) a row a token."""
    if isinstance(module, FusedMoE):
        experts = module.w13.shape[0]
        return active_experts(experts, module.top_k, tokens) / experts
    if type(module) is VocabEmbedding:
        return min(tokens, module.rows) / module.rows
    return 1.0


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
