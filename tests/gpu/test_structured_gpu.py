"""On the GPU: structured outputs under async scheduling and CUDA graphs. The bitmask on the
device equals the CPU's; constrained JSON validates; async (mask deferred behind the token in
flight) gives the synchronous engine's tokens in every decode graph mode."""

import json

import jsonschema
import pytest
import torch
from helpers import make_hf_checkpoint
from oracle import engine

from ostinato import SamplingParams
from ostinato.kernels.bitmask import apply_token_bitmask
from ostinato.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.gpu

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))


def test_bitmask_on_the_device_equals_the_cpu():
    """The Triton kernel at Qwen3's size (24 of 32 rows constrained, by a mask as wide as its
    151669-id tokenizer) against the torch path on the CPU."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 151936, generator=gen)
    rows = torch.randperm(32, generator=gen)[:24].sort().values.to(torch.int32)
    bits = torch.randint(-(2**31), 2**31 - 1, (24, 4740), generator=gen).to(torch.int32)
    want = logits.clone()
    apply_token_bitmask(want, rows, bits)
    got = logits.cuda()
    apply_token_bitmask(got, rows.cuda(), bits.cuda())
    assert torch.equal(got.cpu(), want)


def _workload(llm):
    so = StructuredOutputsParams(json=SCHEMA)
    temperatures = [0.0, 0.0, 1.0, 1.0, 0.7, 0.7]
    constraints = [None, so] * 3
    params = [
        SamplingParams(temperature=t, seed=i, max_tokens=80, structured_outputs=c)
        for i, (t, c) in enumerate(zip(temperatures, constraints, strict=True))
    ]
    prompts = [[5 + i] * (3 + 7 * i) for i in range(6)]
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("mode", ["none", "full_and_piecewise", "full_decode_only"])
def test_async_constrained_equals_sync(checkpoint, mode):
    sync = [o.token_ids for o in _workload(engine(checkpoint, "none", async_scheduling=False))]
    llm = engine(checkpoint, mode, async_scheduling=True)
    outs = _workload(llm)
    assert [o.token_ids for o in outs] == sync
    for out in outs[1::2]:
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.finish_reason == "stop"
