"""On the GPU: async scheduling (the next step launched while the device runs the last, its
unknown input tokens copied in on the device) gives the synchronous engine's tokens in every
graph mode, with the graph checker on, and really keeps two steps in flight."""

import gc

import pytest
import torch
from helpers import make_hf_checkpoint, overlapped_submits
from oracle import MODES, engine, mixed_workload

from ostinato import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    return make_hf_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def sampled_workload(llm) -> list[list[int]]:
    """Seeded sampling with top-k/top-p and logprobs: the sampler's device path."""
    prompts = [[5 + i] * (3 + 17 * i) for i in range(6)]
    params = [
        SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=i, max_tokens=9 + i, logprobs=1)
        for i in range(6)
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.token_ids, [sorted(lp) for lp in o.logprobs]) for o in outs]


def test_async_equals_sync_in_every_mode(checkpoint):
    torch.backends.cuda.matmul.allow_tf32 = False
    sync = engine(checkpoint, "none", async_scheduling=False)
    greedy, sampled = mixed_workload(sync), sampled_workload(sync)
    del sync
    for mode in MODES:
        llm = engine(checkpoint, mode, async_scheduling=True, check_graphs=1)
        assert llm.engine.executor.max_in_flight == 2
        submits = overlapped_submits(llm)
        assert mixed_workload(llm) == greedy, mode
        assert sampled_workload(llm) == sampled, mode
        assert submits.count(1) > len(submits) // 2, mode  # launched behind a step in flight
        del llm
        gc.collect()


def test_async_is_the_default_on_one_gpu(checkpoint):
    llm = engine(checkpoint, "full_and_piecewise")
    assert llm.engine.config.async_scheduling and llm.engine.executor.max_in_flight == 2
