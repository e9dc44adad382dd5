"""check_graphs shown to fail: on the CPU the runner's graph is replaced by a stand-in (the eager
forward, with a divergence planted on one descriptor) and the dispatcher by one that pads to
PIECEWISE keys, so the engine's own step path runs the check and must name the descriptor.
tests/gpu/test_check_graphs.py does the same with a real captured graph."""

from __future__ import annotations

import pytest
import torch

from ostinato import LLM, SamplingParams
from ostinato.graphs.modes import BatchDescriptor, CudaGraphMode

PROMPT = list(range(2, 13))  # 11 tokens: the prefill pads to 16, each decode to 1


def padded(num_tokens: int) -> int:
    return 1 << (num_tokens - 1).bit_length()


def planted_engine(check_graphs: int, plant, monkeypatch) -> LLM:
    """An engine whose graphs are `plant(desc, eager output, live tokens)`."""
    llm = LLM("tiny", device="cpu", max_model_len=64, num_kv_blocks=16, check_graphs=check_graphs)
    graphs = llm.engine.runner.graphs

    def dispatch(num_tokens, num_reqs, uniform_query_len, num_loras):
        return CudaGraphMode.PIECEWISE, BatchDescriptor(padded(num_tokens), None, None, num_loras)

    def run(mode, desc, num_tokens, forward):
        return plant(desc, forward(), num_tokens)

    monkeypatch.setattr(graphs, "dispatch", dispatch)
    monkeypatch.setattr(graphs, "run", run)
    return llm


def generate(llm: LLM, max_tokens: int = 3) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].token_ids


def test_a_graph_that_diverges_is_named_by_its_descriptor(monkeypatch):
    def plant(desc, out, num_tokens):
        if desc.num_tokens == 16:  # the prefill's graph: one live value off
            out = out.clone()
            out[num_tokens - 1, 5] += 0.5
        return out

    llm = planted_engine(1, plant, monkeypatch)
    with pytest.raises(RuntimeError) as failure:
        generate(llm)
    message = str(failure.value)
    assert "CUDA graph check failed for piecewise" in message
    assert str(BatchDescriptor(16, None, None, 0)) in message and "hidden states" in message


def test_agreeing_graphs_and_padding_rows_pass(monkeypatch):
    """Rows past the live tokens are padding: what a graph leaves there is not compared, and a
    difference within the tolerance (1% of the largest value) is not a failure."""

    def plant(desc, out, num_tokens):
        out = out.clone()
        out[num_tokens:] += 100.0
        out[:num_tokens] *= 1.001
        return out

    llm = planted_engine(1, plant, monkeypatch)
    tokens = generate(llm)
    monkeypatch.undo()
    assert tokens == generate(LLM("tiny", device="cpu", max_model_len=64, num_kv_blocks=16))
    assert llm.engine.runner.num_graph_checks == 3  # the prefill and two decodes


@pytest.mark.parametrize(("every", "fails"), [(0, False), (2, True), (3, False)])
def test_check_graphs_checks_every_nth_graphed_step(monkeypatch, every, fails):
    """The divergence is planted in the second graphed step only (the first decode)."""
    steps = []

    def plant(desc, out, num_tokens):
        steps.append(desc)
        return out + 1.0 if len(steps) == 2 else out

    llm = planted_engine(every, plant, monkeypatch)
    if fails:
        with pytest.raises(RuntimeError, match=r"BatchDescriptor\(num_tokens=1,"):
            generate(llm)
    else:
        assert len(generate(llm)) == 3
        assert len(steps) == 3


def test_a_non_finite_graph_output_fails_the_check(monkeypatch):
    def plant(desc, out, num_tokens):
        return torch.full_like(out, float("nan"))

    llm = planted_engine(1, plant, monkeypatch)
    with pytest.raises(RuntimeError, match="CUDA graph check failed"):
        generate(llm)
