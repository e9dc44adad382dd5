"""On the GPU: speculative decoding in every graph mode against eager, and the FULL graphs of
verify steps (q = 1 + k) really replayed."""

import gc

import pytest
import torch
from helpers import make_hf_checkpoint

from ostinato import LLM, SamplingParams

pytestmark = pytest.mark.gpu

K = 3
SPEC = {"speculative_method": "ngram", "num_speculative_tokens": K}
MODES = ["none", "piecewise", "full", "full_decode_only", "full_and_piecewise"]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    return make_hf_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def engine(checkpoint, mode: str, **kw) -> LLM:
    kw = {"dtype": "float32", "max_num_batched_tokens": 128, "max_num_seqs": 16, **kw}
    kw.setdefault("gpu_memory_utilization", 0.25)
    return LLM(str(checkpoint), cuda_graph_mode=mode, max_capture_size=128, **kw)


def workload(llm: LLM, vocab: int = 300) -> list[list[int]]:
    """Prompts with repeated spans and random ones, long (chunked) and short, decode batches
    of sizes that need padding; a vocabulary of 300 makes proposals frequent."""
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(2, vocab, (n,), generator=g).tolist()
    span = ids(13)
    prompts = [span * 9, ids(3), ids(40), span * 3, [7], ids(129), ids(11) * 2, ids(5), span]
    params = [
        SamplingParams(temperature=0.0, max_tokens=10 + 3 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_every_mode_matches_eager_with_speculation(checkpoint):
    torch.backends.cuda.matmul.allow_tf32 = False
    reference = workload(engine(checkpoint, "none", **SPEC))
    assert reference == workload(engine(checkpoint, "none"))  # as decoding without drafts
    for mode in MODES[1:]:
        llm = engine(checkpoint, mode, check_graphs=1, **SPEC)
        assert workload(llm) == reference, mode
        report, stats = llm.graph_report(), llm.stats()
        assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
        if mode in ("full_decode_only", "full_and_piecewise"):
            captured = {d["uniform_query_len"] for d in report["captured"]["full"]}
            assert captured == {1, 1 + K}, report["captured"]
            assert report["full_decode_steps"].get(str(1 + K), 0) > 0, report
        del llm
        gc.collect()


def test_bfloat16_graph_checker_passes_with_speculation(checkpoint):
    for mode in MODES[1:]:
        llm = engine(checkpoint, mode, dtype="bfloat16", check_graphs=1, **SPEC)
        workload(llm)  # raises if a graphed step's hidden states leave eager's
        steps = llm.graph_report()["steps"]
        assert steps["none"] < sum(steps.values())
        del llm
        gc.collect()


def test_sampling_with_speculation_on_the_gpu(checkpoint):
    llm = engine(checkpoint, "full_and_piecewise", **SPEC)
    prompt = list(range(2, 15)) * 6
    params = [
        SamplingParams(temperature=0.8, top_k=50, seed=i, max_tokens=20 + i) for i in range(6)
    ]
    first = llm.generate([prompt] * 6, params, use_tqdm=False)
    again = llm.generate([prompt] * 6, params, use_tqdm=False)  # prefix-cached, batched anew
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    plain = engine(checkpoint, "full_and_piecewise").generate([prompt] * 6, params, use_tqdm=False)
    assert [o.token_ids for o in first] == [o.token_ids for o in plain]  # seeded draws by position
    assert [len(o.token_ids) for o in first] == [20 + i for i in range(6)]
    assert llm.stats()["spec_draft_tokens"] > 0
    assert llm.graph_report()["full_decode_steps"].get(str(1 + K), 0) > 0


@pytest.mark.parametrize("capture", ["eager", "lazy"])
def test_random_preset_speculates_in_full_graphs(capture):
    llm = LLM(
        "random:qwen3-0.6b",
        max_model_len=1024,
        max_num_seqs=8,
        cuda_graph_capture=capture,
        **SPEC,
    )
    outs = llm.generate(
        ["Hello " * 20] * 4, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    )
    assert all(len(o.token_ids) == 32 for o in outs)
    report = llm.graph_report()
    assert report["full_decode_steps"].get(str(1 + K), 0) > 0, report
    assert llm.stats()["spec_acceptance_rate"] > 0
