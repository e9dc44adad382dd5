"""explain: the resolved mode, the decisions and the capture sizes, with no weights or GPU."""

import json

import pytest
import torch
from torch import nn

from ostinato.config import EngineConfig
from ostinato.footprint import describe, step_weight_bytes
from ostinato.graphs.explain import explain
from ostinato.layers.embedding import LMHead, VocabEmbedding
from ostinato.loader import load_hf_config
from ostinato.quantization import resolve_quantization


@pytest.fixture
def no_cuda_calls(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("explain must not query CUDA")

    for name in ("is_available", "device_count", "mem_get_info", "get_device_properties", "init"):
        monkeypatch.setattr(torch.cuda, name, refuse)


def test_cuda_config_on_a_machine_without_a_gpu(no_cuda_calls):
    out = json.loads(json.dumps(explain(EngineConfig(device="cuda"))))
    assert set(out) == {
        "cuda_graph_mode",
        "requested_mode",
        "decisions",
        "cuda_graph_capture",
        "capture_sizes",
        "lora_counts",
        "config",
    }
    assert out["cuda_graph_mode"] == out["requested_mode"] == "full_and_piecewise"
    assert out["cuda_graph_capture"] == "eager"
    assert out["capture_sizes"]["full"][-1] == 256
    # both lists: FULL decode graphs to max_num_seqs, token graphs to max_num_batched_tokens
    assert out["capture_sizes"]["piecewise"][-1] == 8192
    assert out["capture_sizes"]["piecewise"][-18:-16] == [480, 512]
    assert out["config"]["device"] == "cuda"
    assert out["config"]["attention_backend"] == "triton"


def test_torch_backend_downgrade_is_explained(no_cuda_calls):
    out = explain(EngineConfig(device="cuda", attention_backend="torch"))
    assert out["cuda_graph_mode"] == "piecewise"
    assert out["decisions"][0]["rule"] == "backend_not_capturable"
    assert "torch" in out["decisions"][0]["reason"]
    assert out["capture_sizes"]["full"] == []


def test_cpu_has_no_sizes():
    out = explain(EngineConfig(device="cpu", cuda_graph_mode="full"))
    assert out["cuda_graph_mode"] == "none"
    assert out["capture_sizes"] == {
        "full": [],
        "piecewise": [],
        "full_prefill": {"num_tokens": [], "num_reqs": []},
        "full_tokens": [],
    }
    assert "CUDA graphs need a CUDA device" in out["decisions"][0]["reason"]


@pytest.mark.parametrize(
    ("mode", "full", "piecewise"),
    [("full", 64, 0), ("full_decode_only", 8, 0), ("piecewise", 0, 64), ("none", 0, 0)],
)
def test_sizes_follow_the_mode(mode, full, piecewise):
    cfg = EngineConfig(device="cuda", cuda_graph_mode=mode, max_num_seqs=8, max_capture_size=64)
    sizes = explain(cfg)["capture_sizes"]
    assert max(sizes["full"], default=0) == full
    assert max(sizes["piecewise"], default=0) == piecewise


def test_lazy_capture_is_shown_on_the_command_line(capsys):
    from ostinato.cli import main

    assert main(["explain", "--device", "cuda", "--cuda-graph-capture", "lazy", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cuda_graph_capture"] == out["config"]["cuda_graph_capture"] == "lazy"
    assert out["capture_sizes"]["full"]  # the same sizes, captured when first needed
    assert main(["explain", "--device", "cuda", "--cuda-graph-capture", "lazy"]) == 0
    assert "cuda_graph_capture: lazy" in capsys.readouterr().out
    assert main(["explain", "--cuda-graph-capture", "later"]) == 2
    assert "'eager'" in capsys.readouterr().err


def test_speculation_captures_verify_graphs_up_to_max_num_seqs_times_q(no_cuda_calls):
    no_prefill = {"full_prefill_max_tokens": 0}  # FULL prefill graphs reach 2048 tokens
    cfg = EngineConfig(
        device="cuda",
        max_num_seqs=64,
        speculative_method="ngram",
        num_speculative_tokens=4,
        **no_prefill,
    )
    sizes = explain(cfg)["capture_sizes"]
    assert sizes["full"][-1] == 64 and sizes["piecewise"][-1] == 8192
    # FULL graphs of one-token decodes and of 1 + 4 token verify steps
    assert max(sizes["full_tokens"]) == 64 * 5
    assert {1, 2, 64, 5, 10, 320} <= set(sizes["full_tokens"])
    assert (
        explain(EngineConfig(device="cuda", max_num_seqs=64, **no_prefill))["capture_sizes"][
            "full_tokens"
        ][-1]
        == 64
    )


def _explain(model: str, **kwargs) -> dict:
    config = EngineConfig(model=model, device="cuda", **kwargs)
    hf = load_hf_config(model)
    return json.loads(json.dumps(explain(config.for_model(hf), hf)))


def test_explain_shows_the_moe_shape_and_the_experts_a_decode_step_reads(no_cuda_calls):
    out = _explain("random:qwen3-30b-a3b")
    assert out["moe"] == {"experts": 128, "active_experts_per_token": 8,
                          "expert_intermediate_size": 768, "sparse_layers": 48}  # fmt: skip
    assert out["quantization"] is None
    # by hand, in bf16: each layer's 128 experts of 3 x 2048 x 768 weights, and the rest
    expert = 3 * 2048 * 768 * 2
    attention = (2048 * (32 + 4 + 4) * 128 + 32 * 128 * 2048 + 2 * 128 + 2 * 2048 + 128 * 2048) * 2
    lm_head, row, norm = 151936 * 2048 * 2, 2048 * 2, 2048 * 2
    assert out["weight_bytes"] == 48 * (128 * expert + attention) + 2 * lm_head + norm
    # a step reads the LM head whole but of the (untied) embedding only its tokens' rows
    rest = lm_head + norm
    batch_1 = out["decode_step_weight_bytes"]["batch_1"]
    assert batch_1 == 48 * (8 * expert + attention) + rest + row
    # 32 tokens choose about 112 of the 128 experts (uniform routing)
    chosen = 128 * (1 - (120 / 128) ** 32)
    batch_32 = out["decode_step_weight_bytes"]["batch_32"]
    assert abs(batch_32 - (48 * (chosen * expert + attention) + rest + 32 * row)) < 2


def test_explain_shows_fp8_weights_at_one_byte_plus_their_scales(no_cuda_calls):
    bf16 = _explain("random:llama-3.1-8b")
    fp8 = _explain("random:llama-3.1-8b", quantization="fp8")
    assert bf16["quantization"] is None and bf16["moe"] is None
    assert fp8["quantization"] == {"method": "fp8", "weights": "float8_e4m3fn",
                                   "scales": "one per output row (at load)"}  # fmt: skip
    linear = 32 * (4096 * (4096 + 1024 + 1024) + 4096 * 4096 + 3 * 4096 * 14336)
    rows = 32 * (4096 + 1024 + 1024 + 4096 + 2 * 14336 + 4096)  # one float32 scale per row
    assert bf16["weight_bytes"] - fp8["weight_bytes"] == linear * 2 - (linear + rows * 4)
    embedding_not_read = (128256 - 1) * 4096 * 2  # bf16, one row a token
    assert fp8["decode_step_weight_bytes"]["batch_1"] == fp8["weight_bytes"] - embedding_not_read


def test_a_checkpoints_fp8_blocks_are_shown_as_they_are():
    hf = load_hf_config("random:qwen3-0.6b")
    hf.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 64]}
    report = describe(hf, torch.bfloat16, resolve_quantization(None, hf))
    assert report["quantization"]["scales"] == "one per 128x64 block (checkpoint)"


def test_explain_reads_a_checkpoints_fp8_blocks_from_its_config(no_cuda_calls):
    """explain asks the model's config for its quantisation, not only the flag."""
    hf = load_hf_config("random:qwen3-0.6b")
    hf.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    out = explain(EngineConfig(model="random:qwen3-0.6b", device="cuda").for_model(hf), hf)
    assert out["quantization"]["scales"] == "one per 128x128 block (checkpoint)"


def test_explain_shows_each_stage_its_ranks_layers_and_ends(no_cuda_calls):
    """Three stages of two tensor ranks over an uneven partition: each stage's ranks and
    layers, the embedding on the first alone and the LM head and sampler on the last alone."""
    out = _explain("random:qwen3-0.6b", pipeline_parallel_size=3, tensor_parallel_size=2,
                   pp_layer_partition=[10, 12, 6])  # fmt: skip
    assert out["stages"] == [
        {"stage": 0, "ranks": [0, 1], "layers": [0, 10], "embedding": True,
         "lm_head_and_sampler": False},
        {"stage": 1, "ranks": [2, 3], "layers": [10, 22], "embedding": False,
         "lm_head_and_sampler": False},
        {"stage": 2, "ranks": [4, 5], "layers": [22, 28], "embedding": False,
         "lm_head_and_sampler": True},
    ]  # fmt: skip


@pytest.mark.parametrize(
    "tp, share",
    [
        # qwen3-0.6b: 16 attention heads, 8 KV heads, a vocabulary of 151,936
        (1, {"attention_heads_per_rank": 16, "kv_heads_per_rank": 8, "ranks_per_kv_head": 1,
             "vocab_rows_per_rank": 151936}),
        (4, {"attention_heads_per_rank": 4, "kv_heads_per_rank": 2, "ranks_per_kv_head": 1,
             "vocab_rows_per_rank": 37984}),
        # more ranks than KV heads: each KV head on two ranks
        (16, {"attention_heads_per_rank": 1, "kv_heads_per_rank": 1, "ranks_per_kv_head": 2,
              "vocab_rows_per_rank": 9496}),
    ],
)  # fmt: skip
def test_explain_shows_each_tensor_ranks_share(no_cuda_calls, tp, share):
    out = _explain("random:qwen3-0.6b", tensor_parallel_size=tp)
    assert out["tensor_parallel"] == {"size": tp, **share}
    assert all(type(v) is int for v in out["tensor_parallel"].values())


def test_a_tied_weight_counts_at_its_largest_share_in_either_module_order():
    head, embedding = LMHead(100, 8), VocabEmbedding(100, 8)
    embedding.weight = head.weight
    for modules in ((head, embedding), (embedding, head)):
        assert step_weight_bytes(nn.Sequential(*modules), tokens=1) == 100 * 8 * 4


def test_a_tied_embedding_counts_whole_in_a_decode_step(no_cuda_calls):
    """qwen3-0.6b's LM head is its embedding: a step reads every row through the head."""
    out = _explain("random:qwen3-0.6b")
    assert out["decode_step_weight_bytes"]["batch_1"] == out["weight_bytes"]


def test_full_prefill_sizes_are_shown_apart_and_follow_the_cap(no_cuda_calls):
    sizes = explain(EngineConfig(device="cuda"))["capture_sizes"]
    assert sizes["full_prefill"]["num_reqs"] == [1, 4]
    tokens = sizes["full_prefill"]["num_tokens"]
    assert (tokens[0], tokens[-1], len(tokens)) == (64, 2048, 29)
    assert sizes["full"][-1] == 256  # the decode list is its own
    capped = explain(EngineConfig(device="cuda", max_capture_size=300))["capture_sizes"]
    assert capped["full_prefill"]["num_tokens"][-2:] == [288, 300]
    for off in ({"cuda_graph_mode": "piecewise"}, {"enable_lora": True}):
        out = explain(EngineConfig(device="cuda", **off))
        assert out["capture_sizes"]["full_prefill"] == {"num_tokens": [], "num_reqs": []}
    lora = explain(EngineConfig(device="cuda", enable_lora=True))
    assert "full_prefill_off_with_lora" in [d["rule"] for d in lora["decisions"]]
