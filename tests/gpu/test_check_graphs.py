"""check_graphs on a real captured graph: after capture the runner's input_ids buffer is
swapped for a new tensor holding a token no step inputs. The graphs still read the old one,
which each step's unpack kernel still fills; the eager re-run reads the new one, whose tokens
are wrong (every forward embeds its input_ids; positions would not do: an eager decode step's
RoPE reads the sequence lengths). The check must fail and name the graph's descriptor."""

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


def swap_input_ids(llm, avoid: list[int]) -> None:
    buffers = llm.engine.runner.buffers.device
    stranger = next(t for t in range(1, 100) if t not in avoid)
    buffers["input_ids"] = torch.full_like(buffers["input_ids"], stranger)


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
    swap_input_ids(llm, PROMPT + expected)
    with pytest.raises(RuntimeError, match="CUDA graph check failed") as failure:
        generate(llm)
    assert named in str(failure.value), str(failure.value)
    assert len(expected) == 4
