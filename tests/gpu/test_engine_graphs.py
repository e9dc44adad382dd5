"""On the GPU: the engine against Hugging Face, and every graph mode against eager."""

import gc

import pytest
import torch
from helpers import make_hf_checkpoint
from oracle import (
    MODES,
    engine,
    hf_greedy,
    hf_margins,
    hf_model,
    mixed_workload,
    oracle_prompts,
    run_ostinato,
)

from ostinato import LLM, SamplingParams

pytestmark = pytest.mark.gpu

MAX_NEW = 12


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    return make_hf_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_oracle_bfloat16(checkpoint, backend):
    """Tokens equal HF's, or each chosen token is within bf16 rounding of HF's best."""
    prompts = oracle_prompts(300)
    _, ours = run_ostinato(
        checkpoint,
        prompts,
        MAX_NEW,
        dtype="bfloat16",
        attention_backend=backend,
        gpu_memory_utilization=0.25,
    )
    model = hf_model(checkpoint, "cuda")
    expected = hf_greedy(model, prompts, MAX_NEW)
    for prompt, got, want in zip(prompts, ours, expected, strict=True):
        if got != want:
            margins = hf_margins(model, prompt, got)
            assert max(margins) < 0.05 * (1 + max(abs(m) for m in margins)), (got, want, margins)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_oracle_float32_exact(checkpoint, backend):
    prompts = oracle_prompts(300, seed=3)
    _, ours = run_ostinato(
        checkpoint,
        prompts,
        MAX_NEW,
        dtype="float32",
        attention_backend=backend,
        gpu_memory_utilization=0.25,
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    assert ours == hf_greedy(hf_model(checkpoint, "cuda"), prompts, MAX_NEW)


def test_every_mode_matches_eager_token_for_token(checkpoint):
    torch.backends.cuda.matmul.allow_tf32 = False
    reference = mixed_workload(engine(checkpoint, "none"))
    for mode in MODES[1:]:
        llm = engine(checkpoint, mode, check_graphs=1)
        assert mixed_workload(llm) == reference, mode
        report = llm.graph_report()
        steps = report["steps"]
        assert report["cuda_graph_mode"] == mode
        if mode in ("piecewise", "full_and_piecewise"):
            assert steps["piecewise"] > 0, report
        if mode in ("full", "full_decode_only", "full_and_piecewise"):
            assert steps["full"] > 0, report
        if mode == "full_decode_only":
            assert steps["none"] > 0 and steps["piecewise"] == 0
        assert report["padded_tokens"] > 0
        assert report["capture_seconds"] > 0 and report["graph_memory_bytes"] > 0
        del llm
        gc.collect()


def test_bfloat16_graph_checker_passes_in_every_mode(checkpoint):
    for mode in MODES[1:]:
        llm = engine(checkpoint, mode, dtype="bfloat16", check_graphs=1)
        mixed_workload(llm)  # raises if a graphed step's logits leave eager's
        assert llm.graph_report()["steps"]["none"] < sum(llm.graph_report()["steps"].values())
        del llm
        gc.collect()


def test_torch_backend_resolves_to_piecewise_and_matches(checkpoint):
    torch.backends.cuda.matmul.allow_tf32 = False
    reference = mixed_workload(engine(checkpoint, "none", attention_backend="torch"))
    llm = engine(checkpoint, "full_and_piecewise", attention_backend="torch")
    report = llm.graph_report()
    assert report["cuda_graph_mode"] == "piecewise"
    assert report["decisions"] and report["captured"]["full"] == []
    assert mixed_workload(llm) == reference
    assert llm.graph_report()["steps"]["full"] == 0


def test_debug_graph_addresses_runs_clean(checkpoint):
    llm = engine(checkpoint, "full_and_piecewise", debug_graph_addresses=True)
    mixed_workload(llm)
    stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_random_preset_generates_with_graphs():
    llm = LLM("random:qwen3-0.6b", max_model_len=1024, max_num_seqs=32)
    outs = llm.generate(
        ["Hello"] * 3, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    assert all(len(o.token_ids) == 8 for o in outs)
    report = llm.graph_report()
    assert report["cuda_graph_mode"] == "full_and_piecewise"
    assert report["steps"]["full"] > 0 and report["graph_memory_bytes"] > 0
