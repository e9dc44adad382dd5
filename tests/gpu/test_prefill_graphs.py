"""On the GPU: prefill-heavy batches through the token graphs that now reach the step budget.

Prompts of 1k-8k tokens (several chunks each), prefix-cache hits, and prompts arriving while
others decode give the same greedy tokens in every graph mode as eager, with the graph
checker re-running every graphed step; no step falls back to eager in a graph mode, because
the largest token graph is max_num_batched_tokens.
"""

import pytest
import torch
from helpers import make_hf_checkpoint
from oracle import MODES

from ostinato import LLM, SamplingParams

pytestmark = pytest.mark.gpu

BUDGET = 2048  # max_num_batched_tokens: an 8k prompt is 4 chunks, graphs reach 2048 tokens
VOCAB = 300


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"prefill-{request.param}")
    return make_hf_checkpoint(request.param, path, max_position_embeddings=16384)


def _engine(checkpoint, mode: str, **kw) -> LLM:
    kw = {"max_num_batched_tokens": BUDGET, **kw}
    return LLM(
        str(checkpoint),
        cuda_graph_mode=mode,
        dtype="float32",
        max_num_seqs=16,
        max_model_len=8300,
        gpu_memory_utilization=0.3,
        **kw,
    )


def _ids(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=g).tolist()


def prefill_heavy(llm: LLM) -> list[list[int]]:
    """Three rounds: long prompts beside short ones (the short ones decode while the long ones
    are still chunked), then prompts sharing the first round's prefixes (prefix-cache hits),
    then a batch of 1k-3k prompts."""
    g = torch.Generator().manual_seed(0)
    params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
    first = [_ids(g, n) for n in (8000, 5, 1500, 40, 3000, 700, 1)]
    shared = [first[0][:4096] + _ids(g, 300), first[2][:1024] + _ids(g, 17), _ids(g, 2500)]
    third = [_ids(g, n) for n in (1024, 2047, 2049, 3000, 1100)]
    outs = []
    for prompts in (first, shared, third):
        batch = [params(8 + 5 * (i % 4)) for i in range(len(prompts))]
        outs += [o.token_ids for o in llm.generate(prompts, batch, use_tqdm=False)]
    return outs


def test_prefill_heavy_batches_match_eager_in_every_mode(checkpoint):
    torch.backends.cuda.matmul.allow_tf32 = False
    eager = _engine(checkpoint, "none")
    reference = prefill_heavy(eager)
    assert eager.stats()["prefix_cache_hits"] > 0
    del eager
    for mode in MODES[1:]:
        llm = _engine(checkpoint, mode, check_graphs=1)
        assert prefill_heavy(llm) == reference, mode
        report = llm.graph_report()
        assert report["dropped"] == [], report["dropped"]
        token_graphs = report["captured"]["full" if mode == "full" else "piecewise"]
        if mode != "full_decode_only":
            # every step, chunks of 2048 included, replayed a graph
            assert report["steps"]["none"] == 0, (mode, report["steps"])
            assert max(d["num_tokens"] for d in token_graphs) == BUDGET
        assert report["graph_memory_bytes"] <= report["graph_memory_budget_bytes"], report
        del llm


def test_lazy_capture_takes_large_graphs_on_first_use(checkpoint):
    """Lazy capture: a 2048-token chunk captures its graph when it first runs, and the output
    is eager's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(5)
    prompts = [_ids(g, 4500), _ids(g, 900)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in _engine(checkpoint, "none").generate(prompts, params)]
    llm = _engine(checkpoint, "piecewise", cuda_graph_capture="lazy", check_graphs=1)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    captured = {d["num_tokens"] for d in llm.graph_report()["captured"]["piecewise"]}
    assert BUDGET in captured and len(captured) < 10  # only the sizes the steps needed


def test_fresh_prompt_steps_through_sdpa_match_the_paged_kernel(checkpoint, monkeypatch):
    """Steps of whole fresh prompts of >= SDPA_MIN_TOKENS go to torch's SDPA: a long prompt's
    first chunk and two equal prompts in one step give the greedy tokens of the paged kernel,
    in every graph mode (float32: SDPA's memory-efficient kernel; bf16 cuDNN is tested
    against float64 in test_kernels.py)."""
    from ostinato.attention import triton_backend

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(7)
    rounds = [[_ids(g, 6000)], [_ids(g, 2100), _ids(g, 2100)]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(mode: str) -> list[list[int]]:
        llm = _engine(checkpoint, mode, max_num_batched_tokens=8192, enable_prefix_caching=False)
        tokens = [o.token_ids for r in rounds for o in llm.generate(r, params, use_tqdm=False)]
        llm.shutdown()
        return tokens

    sdpa_steps = []
    causal_prefill = triton_backend.causal_prefill
    monkeypatch.setattr(
        triton_backend, "causal_prefill", lambda *a: sdpa_steps.append(a[4:6]) or causal_prefill(*a)
    )
    with monkeypatch.context() as m:
        m.setattr(triton_backend, "SDPA_MIN_TOKENS", 1 << 62)
        paged = run("none")
    assert not sdpa_steps
    for mode in MODES:
        sdpa_steps.clear()
        assert run(mode) == paged, mode
        if mode != "full":  # FULL graphs of every batch keep attention inside: the paged kernel
            assert {(1, 6000), (2, 2100)} <= set(sdpa_steps), (mode, set(sdpa_steps))
