"""On the GPU: penalties, min_p, min_tokens, logit_bias and prompt logprobs give the same
tokens with async scheduling (the token in flight counted on the device) as without, in every
graph mode, with chunked prefill."""

import pytest
import torch
from test_sampling_params import engine_workload

from ostinato import LLM

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["none", "full_and_piecewise"])
def test_async_equals_sync_with_every_setting(mode):
    kw = {"device": "cuda", "max_model_len": 256, "cuda_graph_mode": mode, "dtype": "float32"}
    want = engine_workload(LLM("tiny", async_scheduling=False, **kw))
    got = engine_workload(LLM("tiny", async_scheduling=True, max_num_batched_tokens=16, **kw))
    for (tokens, reason, prompt), (tokens_w, reason_w, prompt_w) in zip(got, want, strict=True):
        assert (tokens, reason) == (tokens_w, reason_w)
        for entry, entry_w in zip(prompt or [], prompt_w or [], strict=True):
            assert (entry is None) == (entry_w is None)
