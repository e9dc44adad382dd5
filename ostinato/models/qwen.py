"""Qwen2/Qwen2.5 (bias on q, k, v) and Qwen3 (per-head RMSNorm on q and k): Llama otherwise."""

from __future__ import annotations

from ostinato.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config) -> dict:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config) -> dict:
        bias = getattr(config, "attention_bias", False)
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
