"""Hugging Face architecture name -> model class."""

from __future__ import annotations

from torch import nn

from ostinato.models.llama import LlamaForCausalLM
from ostinato.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from ostinato.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # the same network; a sliding window is refused
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def get_model_class(hf_config) -> type[nn.Module]:
    """The class for the config's `architectures`; ValueError naming it if we have none."""
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODELS:
            return MODELS[arch]
    named = ", ".join(archs) if archs else "no architecture (config.json lacks 'architectures')"
    raise ValueError(f"unsupported architecture {named}: ostinato supports {', '.join(MODELS)}")
