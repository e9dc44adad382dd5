"""benchmarks/profile_step.py's CPU-capable sections on the tiny model: the script the GPU
sessions run must not break unseen between them (its phases section once called the runner's
logits with a signature it had lost)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest


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
