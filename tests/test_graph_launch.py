"""benchmarks/graph_launch.py's refusals, on the CPU (it times CUDA graphs only on a GPU)."""

import sys

import pytest
from helpers import load_benchmark


@pytest.fixture(scope="module")
def graph_launch():
    return load_benchmark("graph_launch")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kernels", "64,x"], "--kernels takes positive counts"),
        (["--kernels", "0"], "--kernels takes positive counts"),
        (["--replays", "0"], "--replays at least 1"),
        ([], "needs a CUDA device"),
    ],
)
def test_bad_flags_and_no_gpu_are_refused(graph_launch, monkeypatch, capsys, flags, message):
    monkeypatch.setattr(graph_launch.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["graph_launch.py", *flags])
    with pytest.raises(SystemExit):
        graph_launch.main()
    assert message in capsys.readouterr().err
