"""What the graph runtime would do with a configuration, without weights or a GPU."""

from __future__ import annotations

from dataclasses import asdict

from ostinato.config import EngineConfig
from ostinato.footprint import describe
from ostinato.graphs.compat import resolve
from ostinato.graphs.dispatcher import Dispatcher
from ostinato.layout import kv_heads_per_rank, stage_layers
from ostinato.quantization import resolve_quantization


def explain(config: EngineConfig, hf_config=None) -> dict:
    """The resolved mode, every rule that fired, the sizes that would be captured (each once
    per active-adapter count of lora_counts), and the config; with the model's hf_config,
    each pipeline stage's share and each tensor rank's (every stage captures the same sizes),
    the quantisation, the mixture-of-experts shape and the weight bytes a decode step reads.
    Queries no device, so `device='cuda'` can be checked on a machine without one."""
    resolution = resolve(config)
    plan = resolution.plan
    report = {
        **resolution.as_dict(),
        "cuda_graph_capture": config.cuda_graph_capture,
        "capture_sizes": Dispatcher(resolution.resolved, plan).capture_sizes(),
        "lora_counts": list(plan.lora_counts),
        "config": asdict(config),
    }
    if hf_config is not None:
        report["stages"] = stages(config, hf_config)
        report["tensor_parallel"] = tensor_split(config.tensor_parallel_size, hf_config)
        spec = resolve_quantization(config.quantization, hf_config)
        report.update(describe(hf_config, config.torch_dtype, spec))
    return report


def stages(config: EngineConfig, hf_config) -> list[dict]:
    """Per pipeline stage: its ranks (one per tensor slice), its layers, and whether it holds
    the embedding or the final norm, LM head and sampler."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    layers = stage_layers(hf_config.num_hidden_layers, pp, config.pp_layer_partition)
    return [
        {
            "stage": s,
            "ranks": list(range(s * tp, (s + 1) * tp)),
            "layers": [r.start, r.stop],
            "embedding": s == 0,
            "lm_head_and_sampler": s == pp - 1,
        }
        for s, r in enumerate(layers)
    ]


def tensor_split(tp: int, hf_config) -> dict:
    """What each tensor rank holds: its attention and KV heads (how many ranks share each KV
    head when there are fewer than ranks) and its rows of the vocabulary."""
    kv_heads = hf_config.num_key_value_heads
    return {
        "size": tp,
        "attention_heads_per_rank": hf_config.num_attention_heads // tp,
        "kv_heads_per_rank": kv_heads_per_rank(kv_heads, tp),
        "ranks_per_kv_head": max(1, tp // kv_heads),
        "vocab_rows_per_rank": -(-hf_config.vocab_size // tp),
    }
