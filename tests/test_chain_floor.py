"""benchmarks/chain_floor.py on the CPU (it times CUDA graphs only on a GPU): its refusals, and
that the bytes its chains read are those `bench latency`'s floor counts for the weights."""

import sys
from pathlib import Path

import pytest
import torch
from helpers import load_benchmark

from ostinato.footprint import meta_model, step_weight_bytes
from ostinato.loader import load_hf_config


@pytest.fixture(scope="module")
def chain_floor():
    benchmarks = str(Path(__file__).parents[1] / "benchmarks")
    sys.path.insert(0, benchmarks)  # its sibling scripts, as when run as a script
    try:
        yield load_benchmark("chain_floor")
    finally:
        sys.path.remove(benchmarks)


@pytest.mark.parametrize(
    "flags, cuda, message",
    [
        (["--rows", "1,x"], False, "--rows takes positive batch sizes"),
        (["--rows", "0"], False, "--rows takes positive batch sizes"),
        ([], False, "needs a CUDA device"),
        (["--model", "random:no-such-model"], True, "unknown preset 'no-such-model'"),
    ],
)
def test_bad_flags_and_no_gpu_are_refused(chain_floor, monkeypatch, capsys, flags, cuda, message):
    monkeypatch.setattr(chain_floor.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(sys, "argv", ["chain_floor.py", *flags])
    with pytest.raises(SystemExit):
        chain_floor.main()
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "model, rows",
    [("qwen3-0.6b", 1), ("llama-3.1-8b", 32), ("qwen3-30b-a3b", 1)],
)
def test_the_chains_read_the_weights_the_decode_floor_counts(chain_floor, model, rows):
    """Within the norms' weights and an untied embedding's rows, which no chain reads: a tied
    LM head once, a MoE layer's experts its one token chooses (whole experts: at more tokens
    the chains read the expected count rounded up, the floor its fraction)."""
    c = load_hf_config(f"random:{model}")
    sizes, head = chain_floor.step_reads(c, 2, rows)
    chain = c.num_hidden_layers * sum(sizes) + head
    floor = step_weight_bytes(meta_model(c, torch.bfloat16, None), rows)
    assert chain <= floor < chain * 1.001
