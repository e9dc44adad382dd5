"""Rotary position embedding: a cos|sin table built once per model, applied in place by the
kernel. Supports the `default`, `linear` and `llama3` rope types, as Hugging Face computes them."""

from __future__ import annotations

import math

import torch
from torch import nn

from ostinato.kernels import rope_and_store
from ostinato.layers.norm import RMSNorm

ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config) -> dict:
    """The rope settings under either spelling: `rope_parameters` (transformers 5, theta inside)
    or `rope_scaling` + `rope_theta` (older configs; `type` was once the key for `rope_type`)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    legacy_type = params.pop("type", None)
    params["rope_type"] = params.get("rope_type") or legacy_type or "default"
    if params["rope_type"] not in ROPE_TYPES:
        supported = ", ".join(ROPE_TYPES)
        raise ValueError(
            f"unsupported rope type {params['rope_type']!r}: ostinato supports {supported}"
        )
    return params


def inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    inv_freq = 1.0 / (
        params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    )
    if params["rope_type"] == "linear":
        return inv_freq / params["factor"]
    if params["rope_type"] == "llama3":
        return _llama3_scaling(inv_freq, params)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, params)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        # float32 whatever the model dtype, so positions far into the context stay exact
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def apply_and_store(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        step: dict | None = None,
    ) -> None:
        """Rotates q [T, H, D] and k [T, KH, D] in place by their positions [T] (Qwen3:
        q_norm / k_norm per head first), then stores k and v at slot_mapping, in one kernel.
        `step`: the forward step's dict of RoPE launches (kernels.rope_and_store)."""
        cache = self.cos_sin_cache
        if q_norm is None:
            rope_and_store(q, k, v, positions, cache, k_cache, v_cache, slot_mapping, step=step)
            return
        assert q_norm.eps == k_norm.eps, "the fused kernel takes one eps for q and k"
        rope_and_store(
            q, k, v, positions, cache, k_cache, v_cache, slot_mapping,
            q_norm.weight, k_norm.weight, q_norm.eps, step,
        )  # fmt: skip
