"""EngineConfig: "auto" resolved, and every bad value refused by a ValueError that names the
field, the value and what to do, before anything loads."""

import re
from types import SimpleNamespace

import pytest
import torch

from ostinato.config import DEFAULT_MAX_MODEL_LEN, EngineConfig


def test_auto_resolves_to_the_cpu_defaults_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = EngineConfig()
    assert (config.device, config.dtype, config.attention_backend) == ("cpu", "float32", "torch")
    assert config.torch_dtype is torch.float32 and not config.is_cuda
    assert config.async_scheduling is False  # nothing to overlap without a device
    assert config.world_size == 1


def test_auto_resolves_to_bfloat16_triton_and_async_scheduling_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = EngineConfig()
    assert (config.device, config.dtype, config.attention_backend) == ("cuda", "bfloat16", "triton")
    assert config.is_cuda and config.torch_dtype is torch.bfloat16
    assert config.async_scheduling is True
    several = EngineConfig(device="cuda:1", pipeline_parallel_size=2, tensor_parallel_size=3)
    assert several.is_cuda and several.world_size == 6
    assert several.async_scheduling is False  # several processes: asked for, not assumed


def test_explicit_values_are_kept():
    config = EngineConfig(device="cpu", dtype="half", attention_backend="triton",
                          cuda_graph_mode="FULL", async_scheduling=True)  # fmt: skip
    assert config.torch_dtype is torch.float16 and config.attention_backend == "triton"
    assert config.cuda_graph_mode == "full"  # any case, stored lower
    assert config.async_scheduling is True


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(device="tpu"), "unknown device 'tpu': use 'cpu', 'cuda' or 'auto'"),
        (dict(dtype="int8"), "unknown dtype 'int8': choose one of ['bfloat16', 'float'"),
        (dict(cuda_graph_mode="always"), "unknown cuda_graph_mode 'always': choose one of"),
        (dict(cuda_graph_capture="never"),
         "unknown cuda_graph_capture 'never': choose 'eager' (capture every graph at start-up) "
         "or 'lazy' (capture each graph when a batch first needs it)"),
        (dict(max_num_seqs=0), "max_num_seqs must be at least 1, got 0"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be at least 1, got 0"),
        (dict(max_model_len=0), "max_model_len must be at least 1, got 0"),
        (dict(block_size=0), "block_size must be at least 1, got 0"),
        (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization must be in (0, 1], got 0.0"),
        (dict(gpu_memory_utilization=1.01), "gpu_memory_utilization must be in (0, 1], got 1.01"),
        (dict(max_capture_size=0), "max_capture_size must be at least 1, got 0"),
        (dict(capture_sizes=[8, 0]), "capture_sizes must be positive, got [8, 0]"),
        (dict(capture_sizes=[-2]), "capture_sizes must be positive, got [-2]"),
        (dict(full_prefill_min_tokens=0), "full_prefill_min_tokens must be at least 1"),
        (dict(full_prefill_max_tokens=-1), "full_prefill_max_tokens at least 0"),
        (dict(full_prefill_min_tokens=128, full_prefill_max_tokens=64),
         "full_prefill_max_tokens=64 is below full_prefill_min_tokens=128: raise it, or set it "
         "to 0 to turn FULL prefill graphs off"),
        (dict(full_prefill_min_tokens=2, full_prefill_max_tokens=1),
         "full_prefill_max_tokens=1 is below full_prefill_min_tokens=2"),
        (dict(check_graphs=-1), "check_graphs must be >= 0, got -1"),
        (dict(num_kv_blocks=0), "num_kv_blocks must be at least 1, got 0"),
        (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be at least 1, got 0"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be at least 1, got 0"),
        (dict(pipeline_parallel_size=2, pp_layer_partition=[4]),
         "pp_layer_partition has 1 entries for pipeline_parallel_size=2: give one layer count"),
        (dict(quantization="int4"), "unknown quantization 'int4': choose one of ('fp8',)"),
        (dict(max_loras=0), "max_loras must be at least 1, got 0"),
        (dict(max_lora_rank=0), "max_lora_rank must be in [1, 256], got 0"),
        (dict(max_lora_rank=257), "max_lora_rank must be in [1, 256], got 257"),
        (dict(enable_lora=True, tensor_parallel_size=2),
         "enable_lora does not work with tensor_parallel_size > 1 yet: adapters are not sharded "
         "over tensor ranks; use pipeline_parallel_size instead"),
        (dict(distributed_timeout=0), "distributed_timeout must be positive seconds, got 0"),
        (dict(num_speculative_tokens=2), "num_speculative_tokens=2 needs a speculative_method"),
        (dict(speculative_method="eagle", num_speculative_tokens=2),
         "unknown speculative_method 'eagle': choose one of ('ngram',) or None"),
        (dict(speculative_method="ngram"),
         "speculative_method='ngram' needs num_speculative_tokens >= 1"),
        (dict(speculative_method="ngram", num_speculative_tokens=8, max_num_batched_tokens=8),
         "num_speculative_tokens=8 needs 9 tokens per request and step, more than "
         "max_num_batched_tokens=8: lower num_speculative_tokens or raise max_num_batched_tokens"),
        (dict(ngram_min=0), "need 1 <= ngram_min <= ngram_max, got ngram_min=0 and ngram_max=4"),
        (dict(ngram_min=5), "need 1 <= ngram_min <= ngram_max, got ngram_min=5 and ngram_max=4"),
        (dict(async_scheduling="yes"), "async_scheduling must be True, False or None"),
    ],
)  # fmt: skip
def test_a_bad_value_is_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(**{"device": "cpu", **fields})


@pytest.mark.parametrize(
    "fields",
    [
        dict(max_num_seqs=1, max_num_batched_tokens=1, max_model_len=1, block_size=1),
        dict(gpu_memory_utilization=1.0, check_graphs=0, num_kv_blocks=1, max_capture_size=1),
        dict(full_prefill_min_tokens=1, full_prefill_max_tokens=0),  # FULL prefill graphs off
        dict(full_prefill_min_tokens=64, full_prefill_max_tokens=64),
        dict(max_loras=1, max_lora_rank=1),
        dict(max_lora_rank=256, enable_lora=True),
        dict(speculative_method="ngram", num_speculative_tokens=7, max_num_batched_tokens=8),
        dict(speculative_method="ngram", num_speculative_tokens=1),
        dict(capture_sizes=[1, 2], full_prefill_min_tokens=2, full_prefill_max_tokens=2),
        dict(ngram_min=3, ngram_max=3),
        dict(pipeline_parallel_size=2, pp_layer_partition=(1, 3)),
        dict(quantization="fp8", distributed_timeout=0.5),
    ],
)
def test_values_at_the_edges_are_accepted(fields):
    config = EngineConfig(device="cpu", **fields)
    for name, value in fields.items():
        expected = list(value) if name == "pp_layer_partition" else value
        assert getattr(config, name) == expected  # kept as given (a partition as a list)


def hf(layers=4, heads=8, kv_heads=8, intermediate=64, context=None, **more):
    """A model config as transformers gives it; None leaves an attribute out (configs of
    older models lack num_key_value_heads, some lack max_position_embeddings)."""
    fields = dict(
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=context,
        **more,
    )
    return SimpleNamespace(**{k: v for k, v in fields.items() if v is not None})


def test_for_model_resolves_the_context_length():
    """No max_model_len: the model's context length, capped at DEFAULT_MAX_MODEL_LEN (a model
    without one gets the cap); a given length is kept up to the model's."""
    config = EngineConfig(device="cpu")
    assert config.for_model(hf(context=2048)).max_model_len == 2048
    assert config.for_model(hf(context=131072)).max_model_len == DEFAULT_MAX_MODEL_LEN
    assert config.for_model(hf(context=None)).max_model_len == DEFAULT_MAX_MODEL_LEN
    assert config.max_model_len is None  # for_model returns a new config
    given = EngineConfig(device="cpu", max_model_len=1000, block_size=16)
    assert given.for_model(hf(context=1000)) is given
    assert given.max_blocks_per_seq == 63  # 1000 positions in blocks of 16, the last partial
    with pytest.raises(ValueError, match=re.escape(
        "max_model_len=1000 is above the model's context length (max_position_embeddings=999)"
    )):  # fmt: skip
        given.for_model(hf(context=999))


def test_for_model_refuses_splits_the_model_cannot_take():
    too_deep = EngineConfig(device="cpu", pipeline_parallel_size=5)
    with pytest.raises(ValueError, match="pipeline_parallel_size=5 is more than the model's 4"):
        too_deep.for_model(hf(layers=4))
    assert EngineConfig(device="cpu", pipeline_parallel_size=4).for_model(hf(layers=4))
    partition = EngineConfig(device="cpu", pipeline_parallel_size=2, pp_layer_partition=[1, 2])
    with pytest.raises(ValueError, match="sum to the model's 4 layers"):
        partition.for_model(hf(layers=4))
    split = EngineConfig(device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide its 8 "):
        split.for_model(hf(heads=8))
    assert EngineConfig(device="cpu", tensor_parallel_size=2).for_model(hf(heads=8))


@pytest.mark.parametrize(
    "tp, model, problems, fits",
    [
        (2, hf(heads=3, kv_heads=3, intermediate=64),
         "its 3 attention heads or its 3 KV heads (nor is it a multiple of them)", [1]),
        (2, hf(heads=6, kv_heads=3, intermediate=6),
         "its 3 KV heads (nor is it a multiple of them)", [1, 3, 6]),
        (4, hf(heads=8, kv_heads=8, intermediate=10), "its intermediate_size 10", [1, 2]),
        (2, hf(heads=8, moe_intermediate_size=9), "its moe_intermediate_size 9", [1]),
        (4, hf(heads=6, kv_heads=None, intermediate=12),  # no num_key_value_heads: as many as heads
         "its 6 attention heads or its 6 KV heads (nor is it a multiple of them)", [1, 2, 3, 6]),
    ],
)  # fmt: skip
def test_a_tensor_split_names_what_it_cannot_divide_and_what_would(tp, model, problems, fits):
    config = EngineConfig(device="cpu", tensor_parallel_size=tp)
    message = (
        f"tensor_parallel_size={tp} does not divide {problems}: every tensor rank needs whole "
        f"heads and an equal share of the features; choose tensor_parallel_size in {fits}"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        config.for_model(model)


def test_kv_heads_fewer_than_the_tensor_ranks_are_replicated_not_refused():
    """4 ranks over 2 KV heads: each KV head serves two ranks (4 is a multiple of 2)."""
    assert EngineConfig(device="cpu", tensor_parallel_size=4).for_model(hf(heads=8, kv_heads=2))
    assert EngineConfig(device="cpu").for_model(hf(heads=3, kv_heads=3, intermediate=7))
