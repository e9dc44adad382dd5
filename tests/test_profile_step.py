"""benchmarks/profile_step.py's CPU-capable sections on the tiny model: the script the GPU
sessions run must not break unseen between them (its phases section once called the runner's
logits with a signature it had lost)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from ostinato.engine.engine import LLMEngine


@pytest.fixture(scope="module")
def profile_step():
    path = Path(__file__).parents[1] / "benchmarks" / "profile_step.py"
    spec = importlib.util.spec_from_file_location("profile_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_phases_and_host_sections_run_on_tiny(profile_step, monkeypatch, tmp_path):
    out = tmp_path / "rows.jsonl"
    argv = ["profile_step.py", "--model", "tiny", "--modes", "none", "--batch-sizes", "2",
            "--sections", "phases,host", "--json", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    profile_step.main()
    rows = {r["section"]: r for r in map(json.loads, out.read_text().splitlines())}
    phases = rows["phases"]
    assert phases["step_mode"] == "none" and phases["batch"] == 2
    assert all(phases[p] > 0 for p in ("prepare", "forward", "sample"))
    assert rows["host"]["step_ms_profiled"] > 0 and rows["host"]["top"]


def test_num_loras_gives_the_decode_requests_adapters_in_turn(profile_step, monkeypatch, tmp_path):
    """--num-loras 2: the engine has LoRA on and the profiled decode requests take the two
    random adapters in turn; the rows say how many."""
    taken = []
    add = LLMEngine.add_request
    monkeypatch.setattr(
        LLMEngine,
        "add_request",
        lambda self, *a, lora_request=None, **kw: (
            taken.append(lora_request) or add(self, *a, lora_request=lora_request, **kw)
        ),
    )
    out = tmp_path / "rows.jsonl"
    argv = ["profile_step.py", "--model", "tiny", "--modes", "none", "--batch-sizes", "3",
            "--sections", "phases", "--num-loras", "2", "--lora-rank", "4",
            "--json", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    profile_step.main()
    names = [r.name for r in taken[:3]]
    assert names == ["lora0", "lora1", "lora0"]
    assert json.loads(out.read_text().splitlines()[0])["num_loras"] == 2


@pytest.mark.parametrize("flags", [["--num-loras", "-1"], ["--num-loras", "1", "--lora-rank", "0"]])
def test_bad_lora_flags_are_refused(profile_step, monkeypatch, capsys, flags):
    monkeypatch.setattr(sys, "argv", ["profile_step.py", "--model", "tiny", *flags])
    with pytest.raises(SystemExit):
        profile_step.main()
    assert "--num-loras must be at least 0" in capsys.readouterr().err


def test_a_profiled_decode_step_runs_its_requests_adapters(profile_step, monkeypatch, tmp_path):
    """The kernels and pieces sections run one step by hand (one_decode_step, forward): with
    --num-loras that step must carry the requests' adapters, or the profile shows the base
    step's kernels under a LoRA label (session 22 saw no LoRA kernel in such a profile)."""
    layer = importlib.import_module("ostinato.lora.layer")
    engine = profile_step.build("tiny", "none", loras=1, rank=4)
    adapters = profile_step.random_adapters(engine, 1, 4, str(tmp_path))
    monkeypatch.setattr(profile_step, "_adapters", adapters)
    step = profile_step.one_decode_step(engine, 2)
    shrinks = []
    shrink = layer.lora_shrink
    monkeypatch.setattr(layer, "lora_shrink", lambda *a: shrinks.append(1) or shrink(*a))
    profile_step.forward(engine.runner, step)
    assert step.desc.num_active_loras == 1 and shrinks
