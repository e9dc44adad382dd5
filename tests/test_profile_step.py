"""benchmarks/profile_step.py's CPU-capable sections on the tiny model: the script the GPU
sessions run must not break unseen between them (its phases section once called the runner's
logits with a signature it had lost)."""

import importlib
import json
import sys
from types import SimpleNamespace

import pytest
from helpers import load_benchmark

from ostinato.engine.engine import LLMEngine


@pytest.fixture(scope="module")
def profile_step():
    return load_benchmark("profile_step")


def run_on_tiny(profile_step, monkeypatch, tmp_path, *flags: str) -> list[dict]:
    """main() on the tiny model in mode none with these flags: the rows it writes."""
    out = tmp_path / "rows.jsonl"
    argv = ["profile_step.py", "--model", "tiny", "--modes", "none", *flags, "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    profile_step.main()
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_phases_and_host_sections_run_on_tiny(profile_step, monkeypatch, tmp_path):
    flags = ("--batch-sizes", "2", "--sections", "phases,host")
    rows = {r["section"]: r for r in run_on_tiny(profile_step, monkeypatch, tmp_path, *flags)}
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
    flags = ("--batch-sizes", "3", "--sections", "phases", "--num-loras", "2", "--lora-rank", "4")
    rows = run_on_tiny(profile_step, monkeypatch, tmp_path, *flags)
    names = [r.name for r in taken[:3]]
    assert names == ["lora0", "lora1", "lora0"]
    assert rows[0]["num_loras"] == 2


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


def test_a_step_timeline_splits_the_wall_time(profile_step):
    """Overlapping device work counts once; the device's gaps inside its span are idle time;
    what precedes its first start and follows its last end is the host's. The device's copy
    of the step's range is no activity."""
    events = [
        ("host", profile_step.STEP, 1000.0, 2000.0),
        ("device", profile_step.STEP, 1190.0, 1810.0),
        ("host", profile_step.GRAPH_LAUNCH, 1100.0, 1150.0),
        ("host", "aten::copy_", 1020.0, 1040.0),
        ("device", "gemm", 1200.0, 1400.0),
        ("device", "norm", 1350.0, 1500.0),  # overlaps gemm (PDL)
        ("device", "attention", 1550.0, 1800.0),
        ("device", "copy", 1600.0, 1700.0),  # starts last, inside attention
    ]
    got = profile_step.step_timeline(events)
    want = {"wall_ms": 1.0, "graph_launches": 1, "graph_launch_ms": 0.05, "host_before_ms": 0.2,
            "device_span_ms": 0.6, "device_busy_ms": 0.55, "device_idle_ms": 0.05,
            "host_after_ms": 0.2}  # fmt: skip
    assert got == pytest.approx(want)


def test_the_steps_range_is_no_kernel(profile_step):
    """A CUDA trace shows the profiled step's range on the device too: not a kernel."""
    cuda = profile_step.torch.autograd.DeviceType.CUDA
    timed = ((profile_step.STEP, 900.0), ("gemm", 200.0), ("gemm", 100.0))
    events = [SimpleNamespace(name=n, device_type=cuda, device_time=us) for n, us in timed]
    names, device_us = profile_step.device_kernels(SimpleNamespace(events=lambda: events), True)
    assert names == {"gemm": 2} and device_us == {"gemm": 300.0}


def test_the_prefill_section_runs_on_tiny(profile_step, monkeypatch, tmp_path):
    """On a CPU the timeline has the step's wall time and no device part."""
    traces = tmp_path / "traces"
    traces.mkdir()
    flags = ("--sections", "prefill", "--prefill-lengths", "16", "--trace-dir", str(traces))
    (row,) = run_on_tiny(profile_step, monkeypatch, tmp_path, *flags)
    assert (row["section"], row["tokens"], row["kernels"]) == ("prefill", 16, 0)
    timeline = row["timeline"]
    assert timeline["wall_ms"] > 0 and timeline["device_span_ms"] is None
    trace = json.loads((traces / f"prefill-{row['mode']}-16.json").read_text())
    assert any(e.get("name") == profile_step.STEP for e in trace["traceEvents"])


def test_idle_gaps_open_only_past_the_latest_end_and_sum_by_their_ends(profile_step):
    device = [
        (0.0, 10.0, "segment"),
        (4.0, 6.0, "early"),  # overlaps: no gap, and ends before the segment
        (13.0, 20.0, "attention"),  # 3 idle after the segment, not after "early"
        (25.0, 30.0, "segment"),  # 5 after attention
        (33.0, 34.0, "attention"),  # 3 after the segment again
        (34.0, 35.0, "segment"),  # touching: no gap
    ]
    gaps = profile_step.idle_by_gap(device)
    assert gaps == {"segment -> attention": 6.0, "attention -> segment": 5.0}
    assert profile_step.idle_by_gap([]) == {}


def test_an_unknown_section_is_refused_naming_it_and_the_choices(
    profile_step, monkeypatch, tmp_path, capsys
):
    with pytest.raises(SystemExit):
        run_on_tiny(profile_step, monkeypatch, tmp_path, "--sections", "timline,decode")
    error = capsys.readouterr().err
    assert "unknown --sections timline: choose among " in error
    assert all(name in error for name in ("decode", "step-kernels", "timeline"))
    assert not (tmp_path / "rows.jsonl").exists()  # refused before any engine ran
