"""explain: the resolved mode, the decisions and the capture sizes, with no weights or GPU."""

import json

import pytest
import torch

from ostinato.config import EngineConfig
from ostinato.graphs.explain import explain


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
    assert out["capture_sizes"] == {"full": [], "piecewise": [], "full_tokens": []}
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
    cfg = EngineConfig(
        device="cuda", max_num_seqs=64, speculative_method="ngram", num_speculative_tokens=4
    )
    sizes = explain(cfg)["capture_sizes"]
    assert sizes["full"][-1] == 64 and sizes["piecewise"][-1] == 8192
    # FULL graphs of one-token decodes and of 1 + 4 token verify steps
    assert max(sizes["full_tokens"]) == 64 * 5
    assert {1, 2, 64, 5, 10, 320} <= set(sizes["full_tokens"])
    assert (
        explain(EngineConfig(device="cuda", max_num_seqs=64))["capture_sizes"]["full_tokens"][-1]
        == 64
    )
