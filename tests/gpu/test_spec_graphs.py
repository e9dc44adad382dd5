"""On the GPU: speculative decoding in every graph mode against eager, and the FULL graphs of
verify steps (q = 1 + k) really replayed."""

import gc

import pytest
import torch
from helpers import make_hf_checkpoint
from spec_workloads import ENGINE, SPEC, K, mixed_workload, sampling_workload, self_repeating_tokens

from ostinato import LLM, SamplingParams

pytestmark = pytest.mark.gpu

MODES = ["none", "piecewise", "full", "full_decode_only", "full_and_piecewise"]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    return make_hf_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def repeating(checkpoint):
    """The checkpoint's self-repeating tokens, found on the GPU (see spec_workloads)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = engine(checkpoint, "none")
    tokens = self_repeating_tokens(llm)
    del llm
    gc.collect()
    return tokens


def engine(checkpoint, mode: str, **kw) -> LLM:
    kw = {**ENGINE, **kw}
    kw.setdefault("gpu_memory_utilization", 0.25)
    return LLM(str(checkpoint), cuda_graph_mode=mode, max_capture_size=128, **kw)


def test_every_mode_matches_eager_with_speculation(checkpoint, repeating):
    torch.backends.cuda.matmul.allow_tf32 = False
    workload = lambda llm: mixed_workload(llm, repeating)
    reference = workload(engine(checkpoint, "none", **SPEC))
    assert reference == workload(engine(checkpoint, "none"))  # as decoding without drafts
    for mode in MODES[1:]:
        llm = engine(checkpoint, mode, check_graphs=1, **SPEC)
        assert workload(llm) == reference, mode
        report, stats = llm.graph_report(), llm.stats()
        assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
        if mode in ("full_decode_only", "full_and_piecewise"):
            full = report["captured"]["full"]
            captured = {d["uniform_query_len"] for d in full if d["uniform_query_len"]}
            assert captured == {1, 1 + K}, report["captured"]  # and FULL prefill keys (None)
            assert report["full_decode_steps"].get(str(1 + K), 0) > 0, report
        del llm
        gc.collect()


def test_bfloat16_graph_checker_passes_with_speculation(checkpoint, repeating):
    for mode in MODES[1:]:
        llm = engine(checkpoint, mode, dtype="bfloat16", check_graphs=1, **SPEC)
        mixed_workload(llm, repeating)  # raises if a graphed step's hidden states leave eager's
        steps = llm.graph_report()["steps"]
        assert steps["none"] < sum(steps.values())
        del llm
        gc.collect()


def test_sampling_with_speculation_on_the_gpu(checkpoint):
    llm = engine(checkpoint, "full_and_piecewise", **SPEC)
    first = sampling_workload(llm)
    assert sampling_workload(llm) == first  # prefix-cached, batched anew
    plain = engine(checkpoint, "full_and_piecewise")
    assert sampling_workload(plain) == first  # seeded draws by position
    assert [len(tokens) for tokens in first] == [20 + i for i in range(6)]
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
