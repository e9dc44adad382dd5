"""check_graphs on a real captured graph: after capture the runner's positions buffer is
swapped for a new tensor, so the graphs still read the old one (zeroed here) while the eager
re-run reads the live positions. The check must fail and name the graph's descriptor."""

import pytest
import torch
from helpers import make_hf_checkpoint
from oracle import engine

from ostinato import SamplingParams

pytestmark = pytest.mark.gpu

PROMPT = list(range(2, 13))  # 11 tokens: a PIECEWISE prefill pads to 16; a decode is 1 token


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))


def generate(llm) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].token_ids


def swap_positions(llm) -> None:
    buffers = llm.engine.runner.buffers.device
    captured = buffers["positions"]
    buffers["positions"] = torch.zeros_like(captured)
    captured.zero_()  # what the graphs read from now on


@pytest.mark.parametrize(
    ("mode", "named"),
    [
        ("full_decode_only", "full BatchDescriptor(num_tokens=1, num_reqs=1, "),
        ("piecewise", "piecewise BatchDescriptor(num_tokens=16, "),
    ],
)
def test_a_graph_reading_a_swapped_buffer_is_named(checkpoint, mode, named):
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = engine(checkpoint, mode, check_graphs=1, async_scheduling=False)
    expected = generate(llm)  # the same engine, unswapped, passes its checks
    assert llm.engine.runner.num_graph_checks > 0
    swap_positions(llm)
    with pytest.raises(RuntimeError, match="CUDA graph check failed") as failure:
        generate(llm)
    assert named in str(failure.value), str(failure.value)
    assert len(expected) == 4
