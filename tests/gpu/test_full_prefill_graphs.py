"""On the GPU: FULL prefill graphs. Steps of one to four fresh prompts (100..2048 tokens, and a
3000-token prompt whose second chunk attends after 2048 cached tokens) give eager's greedy
tokens in full_and_piecewise and full, with the graph checker re-running every graphed step, on
the Qwen3 and Llama test checkpoints; every prefill step replays a FULL prefill graph (no step
is piecewise or eager), eagerly captured or captured on first use.
"""

import pytest
import torch
from helpers import make_hf_checkpoint

from ostinato import LLM, SamplingParams

pytestmark = pytest.mark.gpu

BUDGET = 2048  # max_num_batched_tokens, and the largest FULL prefill graph by default
VOCAB = 300
# prompts sent together: each round prefills in one step (1, 4, 4 and 4 padded requests in
# the few-prompt rounds), the 3000-token prompt in two chunks (2048, then 952 after them)
ROUNDS = [[100], [500], [1000], [2048], [300, 700], [100, 200, 400], [500] * 4, [1000, 1048]]
ROUNDS += [[3000]]
PREFILL_STEPS = len(ROUNDS) + 1


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"full-prefill-{request.param}")
    return make_hf_checkpoint(request.param, path, max_position_embeddings=4096)


def _engine(checkpoint, mode: str, **kw) -> LLM:
    kw = {"dtype": "float32", **kw}
    return LLM(
        str(checkpoint),
        cuda_graph_mode=mode,
        max_num_seqs=16,
        max_num_batched_tokens=BUDGET,
        max_model_len=3100,
        gpu_memory_utilization=0.3,
        enable_prefix_caching=False,  # every round prefills all its tokens
        **kw,
    )


def _ids(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=g).tolist()


def _rounds(llm: LLM, rounds: list[list[int]] = ROUNDS) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = []
    for lengths in rounds:
        prompts = [_ids(g, n) for n in lengths]
        outs += [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return outs


def _check_steps(report: dict, prefill_steps: int = PREFILL_STEPS) -> None:
    """Every step replayed a FULL graph (decodes of at most 4 requests included), and the
    prefill steps replayed FULL prefill graphs."""
    steps = report["steps"]
    assert steps["piecewise"] == steps["none"] == 0, steps
    assert report["full_prefill_steps"] == prefill_steps, report["full_prefill_steps"]
    assert report["dropped"] == [], report["dropped"]
    assert report["graph_memory_bytes"] <= report["graph_memory_budget_bytes"], report


def test_few_prompt_prefills_replay_full_graphs_and_match_eager(checkpoint):
    torch.backends.cuda.matmul.allow_tf32 = False
    eager = _engine(checkpoint, "none")
    reference = _rounds(eager)
    eager.shutdown()
    for mode in ("full_and_piecewise", "full"):
        llm = _engine(checkpoint, mode, check_graphs=1)
        assert _rounds(llm) == reference, mode
        _check_steps(llm.graph_report())
        llm.shutdown()


def test_bfloat16_full_prefill_graphs_pass_the_checker(checkpoint):
    """bf16 takes the tuned large-tile attention launch: the graph checker compares every
    FULL prefill replay with an eager re-run of the same step."""
    llm = _engine(checkpoint, "full_and_piecewise", dtype="bfloat16", check_graphs=1)
    _rounds(llm)  # raises if a graphed step's hidden states leave eager's
    _check_steps(llm.graph_report())
    llm.shutdown()


def test_lazy_capture_takes_full_prefill_graphs_on_first_use(checkpoint):
    torch.backends.cuda.matmul.allow_tf32 = False
    rounds = [[500], [300, 450], [500]]  # the last one replays the graph the first captured
    eager = _engine(checkpoint, "none")
    want = _rounds(eager, rounds)
    eager.shutdown()
    llm = _engine(checkpoint, "full_and_piecewise", cuda_graph_capture="lazy", check_graphs=1)
    assert _rounds(llm, rounds) == want
    report = llm.graph_report()
    full = report["captured"]["full"]
    prefill = {(d["num_tokens"], d["num_reqs"]) for d in full if d["uniform_query_len"] is None}
    assert prefill == {(512, 1), (768, 4)}, full
    assert report["captured"]["piecewise"] == [], report["captured"]["piecewise"]
    # a cold first use runs its step eagerly (the warm-up) and captures after it; the third
    # round replays what the first captured
    replays, eager_steps = report["full_prefill_steps"], report["steps"]["none"]
    assert max(1, 3 - eager_steps) <= replays <= 3, (replays, report["steps"])
    llm.shutdown()
