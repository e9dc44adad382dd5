"""On the GPU: the engine against Hugging Face, and every graph mode against eager."""

import gc
import itertools

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
from ostinato.kernels import launch, variants
from ostinato.kernels.gemv import rows_pay

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


def test_oracle_float32_exact_where_the_norm_runs_before_the_kernel(checkpoint):
    """Decode batches of 9-21 rows: the small-batch kernel refuses qkv and gate|up with the
    norm in its prologue there (ROW_LIMITS) and takes them after a norm kernel, SiLU in
    gate|up's epilogue (Linear.plan): still HF's tokens."""
    prompts = [p for seed in (3, 4, 5) for p in oracle_prompts(300, seed=seed)]
    model = hf_model(checkpoint, "cuda")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    hidden = model.config.hidden_size
    qkv = sum(p.out_features for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    for n in (qkv, 2 * mlp.gate_proj.out_features):
        rows = len(prompts)
        assert not rows_pay(rows, n, hidden, normed=True) and rows_pay(rows, n, hidden)
    llm = LLM(str(checkpoint), dtype="float32", max_num_seqs=32, gpu_memory_utilization=0.25)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    ours = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    torch.backends.cuda.matmul.allow_tf32 = False
    assert ours == hf_greedy(model, prompts, MAX_NEW)


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


# ---- lazy capture ------------------------------------------------------------------------
def num_graphs(report: dict) -> int:
    return sum(len(v) for v in report["captured"].values())


@pytest.fixture
def cold_kernels(monkeypatch):
    """No kernel variant counts as warm yet (earlier engines of this process warmed them, and
    compiled them for the cached launches, which skip the capture guard once compiled)."""
    monkeypatch.setattr(variants, "_launched", set())
    monkeypatch.setattr(launch, "_compiled", {})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lazy_capture_matches_eager_capture_token_for_token(checkpoint, dtype, monkeypatch):
    """Every graph mode, the graph checker on: lazy capture (a cold first use runs eagerly as
    the warm-up, then captures; a warm one captures, then replays) gives eager capture's
    tokens. bfloat16 must match too: a step's first use runs the same kernels on the same
    buffers as its graph."""
    torch.backends.cuda.matmul.allow_tf32 = False
    for mode in MODES[1:]:
        eager_capture = engine(checkpoint, mode, dtype=dtype, check_graphs=1)
        reference = mixed_workload(eager_capture)
        eager_report = eager_capture.graph_report()
        del eager_capture
        gc.collect()
        monkeypatch.setattr(variants, "_launched", set())  # cold first uses happen
        monkeypatch.setattr(launch, "_compiled", {})
        llm = engine(checkpoint, mode, dtype=dtype, check_graphs=1, cuda_graph_capture="lazy")
        started = llm.graph_report()
        assert num_graphs(started) == 0 and started["capture_seconds"] == 0, started
        assert mixed_workload(llm) == reference, mode
        report = llm.graph_report()
        assert report["cuda_graph_capture"] == "lazy" and report["dropped"] == []
        assert 0 < num_graphs(report) <= num_graphs(eager_report), report
        assert 0 < report["warmups"] <= num_graphs(report)
        assert report["capture_seconds"] > 0 and report["graph_memory_bytes"] > 0
        # the same steps; a cold first use ran eagerly (as the warm-up), a warm one replayed
        steps, eager_steps = report["steps"], eager_report["steps"]
        assert steps["none"] == eager_steps["none"] + report["warmups"], (steps, eager_steps)
        graphed = steps["full"] + steps["piecewise"]
        assert graphed == eager_steps["full"] + eager_steps["piecewise"] - report["warmups"]
        del llm
        gc.collect()


def test_eager_capture_warms_up_once_per_kernel_variant(checkpoint, cold_kernels):
    llm = engine(checkpoint, "full_and_piecewise", dtype="bfloat16")
    report = llm.graph_report()
    # FULL decode to 16 requests, PIECEWISE to 128 tokens, FULL prefill 64..128 x 1, 4 requests
    assert report["dropped"] == [] and num_graphs(report) == 5 + 12 + 5 * 2
    assert 0 < report["warmups"] < num_graphs(report), report  # not one per size
    mixed_workload(llm)


def test_lazy_graph_memory_in_ascending_order_fits_the_reserve(checkpoint, cold_kernels):
    """Serving usually meets small batches first: capture every key lazily, smallest first,
    and the graph memory still fits what the KV sizing left for graphs."""
    llm = engine(
        checkpoint,
        "full_and_piecewise",
        dtype="bfloat16",
        cuda_graph_capture="lazy",
        enable_prefix_caching=False,  # each prefill runs all its tokens
    )
    sizes = llm.engine.runner.graphs.dispatcher.capture_sizes()
    prefill = sizes["full_prefill"]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    # a prefill of n tokens in one step, then decodes; where n is a FULL prefill size, as one
    # prompt, as many prompts as each FULL prefill key has requests, and as 5 (more than any
    # has: the PIECEWISE key). One token alone is a decode batch, so PIECEWISE size 1 never
    # runs here
    prefills = [n for n in sizes["piecewise"] if n > 1]
    for n in prefills:
        counts = [1, *prefill["num_reqs"], 5] if n in prefill["num_tokens"] else [1]
        for r in dict.fromkeys(counts):
            lens = [n // r + (i < n % r) for i in range(r)]
            llm.generate([list(range(2, 2 + k)) for k in lens], params, use_tqdm=False)
    for n in sizes["full"]:  # n requests decoding together
        llm.generate([[2 + i] for i in range(n)], params, use_tqdm=False)
    report = llm.graph_report()
    assert sorted(d["num_tokens"] for d in report["captured"]["piecewise"]) == prefills, report
    full = report["captured"]["full"]
    assert sorted(d["num_reqs"] for d in full if d["uniform_query_len"]) == sizes["full"], report
    pairs = {(d["num_tokens"], d["num_reqs"]) for d in full if d["uniform_query_len"] is None}
    assert pairs == set(itertools.product(prefill["num_tokens"], prefill["num_reqs"])), report
    budget = llm.engine.runner.graph_memory_budget
    assert 0 < report["graph_memory_bytes"] <= budget, (report["graph_memory_bytes"], budget)
