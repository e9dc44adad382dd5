"""The compatibility table as a matrix: modes x backends x devices x enforce_eager."""

import itertools
import logging

import pytest

from ostinato.attention import ATTENTION_BACKENDS, GraphSupport
from ostinato.attention.triton_backend import TritonAttentionBackend
from ostinato.config import CUDA_GRAPH_MODES, EngineConfig
from ostinato.graphs.capture import GraphRunner
from ostinato.graphs.compat import RULES, resolve
from ostinato.graphs.modes import BatchDescriptor, CudaGraphMode

PIECEWISE, FULL = CudaGraphMode.PIECEWISE, CudaGraphMode.FULL

# What each backend can keep of each mode on a CUDA device, written out by hand.
EXPECTED = {
    "triton": {m: m for m in CUDA_GRAPH_MODES},
    "torch": {
        "none": "none",
        "piecewise": "piecewise",
        "full": "piecewise",
        "full_decode_only": "none",
        "full_and_piecewise": "piecewise",
    },
}
MATRIX = list(itertools.product(CUDA_GRAPH_MODES, ["torch", "triton"], ["cpu", "cuda"], [0, 1]))


def first_rule(mode: str, device: str, eager: int) -> str:
    """The rule that must explain a change, by its cause."""
    if device == "cpu":
        return "cpu_device"
    if eager:
        return "enforce_eager"
    if mode == "full_decode_only":
        return "backend_not_capturable_decode_only"
    return "backend_not_capturable"


def config(mode, backend="triton", device="cuda", eager=False, **kw) -> EngineConfig:
    return EngineConfig(
        device=device, attention_backend=backend, cuda_graph_mode=mode, enforce_eager=eager, **kw
    )


@pytest.mark.parametrize(("mode", "backend", "device", "eager"), MATRIX)
def test_matrix(mode, backend, device, eager):
    res = resolve(config(mode, backend, device, bool(eager)))
    on_cpu_or_eager = device == "cpu" or eager
    expected = "none" if on_cpu_or_eager else EXPECTED[backend][mode]
    assert (res.requested.value, res.resolved.value) == (mode, expected)
    if expected != mode:
        assert res.decisions[0].rule == first_rule(mode, device, eager)
    if mode == "none":
        assert res.decisions == ()
    for d in res.decisions:
        assert d.reason and "{" not in d.reason
    if device == "cpu" and mode != "none":
        assert "CUDA graphs need a CUDA device" in res.decisions[0].reason


@pytest.fixture
def decode_only_backend(monkeypatch):
    class DecodeOnly(TritonAttentionBackend):
        name = "decode_only"
        graph_support = GraphSupport.UNIFORM_DECODE

    monkeypatch.setitem(ATTENTION_BACKENDS, "decode_only", DecodeOnly)
    return "decode_only"


@pytest.fixture
def single_token_backend(monkeypatch):
    class SingleToken(TritonAttentionBackend):
        name = "single_token"
        graph_support = GraphSupport.SINGLE_TOKEN_DECODE

    monkeypatch.setitem(ATTENTION_BACKENDS, "single_token", SingleToken)
    return "single_token"


SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("full", "full_and_piecewise"), ("full_and_piecewise", "full_and_piecewise")]
    + [("full_decode_only", "full_decode_only"), ("piecewise", "piecewise")],
)
def test_uniform_decode_backend_keeps_full_for_speculative_decode(
    decode_only_backend, mode, expected
):
    res = resolve(config(mode, decode_only_backend, **SPEC))
    assert res.resolved.value == expected


@pytest.mark.parametrize(
    ("mode", "plain", "speculative"),
    [
        ("full", "full_and_piecewise", "piecewise"),
        ("full_and_piecewise", "full_and_piecewise", "piecewise"),
        ("full_decode_only", "full_decode_only", "none"),
        ("piecewise", "piecewise", "piecewise"),
    ],
)
def test_single_token_backend_loses_full_graphs_with_speculation(
    single_token_backend, mode, plain, speculative
):
    assert resolve(config(mode, single_token_backend)).resolved.value == plain
    res = resolve(config(mode, single_token_backend, **SPEC))
    assert res.resolved.value == speculative
    if plain != speculative:
        rule = next(d for d in res.decisions if d.rule == "backend_full_for_single_token_decode")
        assert "verifies 4 tokens per request" in rule.reason


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("full", "full_and_piecewise"), ("full_and_piecewise", "full_and_piecewise")]
    + [("full_decode_only", "full_decode_only"), ("piecewise", "piecewise")],
)
def test_uniform_decode_backend_keeps_full_for_decode_only(decode_only_backend, mode, expected):
    res = resolve(config(mode, decode_only_backend))
    assert res.resolved.value == expected
    changed = [d.rule for d in res.decisions][: int(mode != expected)]
    assert changed == (["backend_full_for_decode_only"] if mode != expected else [])


NO_TOKEN_SIZES = {"capture_sizes": [8], "max_capture_size": 4, "max_num_seqs": 16}
NO_DECODE_SIZES = {"capture_sizes": [300], "max_capture_size": 512, "max_num_seqs": 256}
NO_SIZES = {"capture_sizes": [9000]}


@pytest.mark.parametrize(
    ("mode", "limits", "expected"),
    [
        ("full_and_piecewise", NO_TOKEN_SIZES, "full_decode_only"),
        ("full_and_piecewise", NO_DECODE_SIZES, "piecewise"),
        ("full_and_piecewise", NO_SIZES, "none"),
        ("full_decode_only", NO_DECODE_SIZES, "none"),
        ("full", NO_TOKEN_SIZES, "none"),
        ("piecewise", NO_TOKEN_SIZES, "none"),
        ("piecewise", NO_DECODE_SIZES, "piecewise"),
    ],
)
def test_capture_sizes_outside_every_limit(mode, limits, expected):
    assert resolve(config(mode, **limits)).resolved.value == expected


def test_every_rule_fires_somewhere(decode_only_backend, single_token_backend):
    configs = [config(m, b, d, bool(e)) for m, b, d, e in MATRIX]
    configs += [config("full", decode_only_backend), config("full_and_piecewise", **NO_SIZES)]
    configs += [config("full_and_piecewise", single_token_backend, **SPEC)]
    configs += [config("piecewise", enable_lora=True), config("piecewise", max_capture_size=64)]
    configs += [config("full_and_piecewise", enable_lora=True)]
    fired = {d.rule for c in configs for d in resolve(c).decisions}
    assert fired == {rule.name for rule in RULES}


def test_note_names_the_largest_capture_size():
    res = resolve(config("full_and_piecewise", max_capture_size=96))
    assert [d.rule for d in res.decisions] == ["eager_above_capture_size"]
    assert "more than 96 tokens" in res.decisions[0].reason


def test_rules_are_logged_once_at_start_up(caplog):
    with caplog.at_level(logging.INFO, logger="ostinato"):
        runner = GraphRunner(config("full_and_piecewise", "torch"))
    logged = [r.getMessage() for r in caplog.records if "rule" in r.getMessage()]
    assert len(logged) == len(runner.resolution.decisions) == 1
    assert "backend_not_capturable" in logged[0]


def test_no_eager_note_when_token_graphs_reach_the_step_budget():
    assert resolve(config("full_and_piecewise")).decisions == ()
    capped = resolve(config("piecewise", max_capture_size=8191))
    assert [d.rule for d in capped.decisions] == ["eager_above_capture_size"]


def test_cpu_runner_runs_eagerly_and_reports_why():
    runner = GraphRunner(EngineConfig(device="cpu"))
    runner.capture(lambda desc: pytest.fail("nothing is captured on a CPU"))
    mode, desc = runner.dispatch(5, 2, None)
    assert mode.value == "none"
    assert runner.run(mode, desc, 5, lambda: "eager") == "eager"
    report = runner.report()
    assert report["cuda_graph_mode"] == "none"
    assert report["decisions"][0]["rule"] == "cpu_device"
    assert report["steps"] == {"none": 1, "piecewise": 0, "full": 0}
    assert report["captured"] == {"full": [], "piecewise": []}


def test_reasons_name_the_backend_and_both_modes_and_are_logged(caplog):
    config = EngineConfig(device="cuda", attention_backend="torch", cuda_graph_mode="full")
    resolution = resolve(config)
    reason = resolution.as_dict()["decisions"][0]["reason"]
    assert reason.startswith("attention backend 'torch' cannot run inside a CUDA graph, so full ")
    assert "full becomes piecewise" in reason
    assert resolution.as_dict()["requested_mode"] == "full"
    assert resolution.as_dict()["cuda_graph_mode"] == "piecewise"
    with caplog.at_level(logging.INFO, logger="ostinato"):
        resolution.log()
    decisions = resolution.as_dict()["decisions"]
    assert caplog.messages == [
        "cuda graph mode: piecewise (requested full)",
        *(f"cuda graph rule {d['rule']}: {d['reason']}" for d in decisions),
    ]
    assert decisions[0]["rule"] == "backend_not_capturable"


def test_the_cpu_reason_names_the_device():
    (decision,) = resolve(EngineConfig(device="cpu")).decisions
    assert decision.reason == "CUDA graphs need a CUDA device (device=cpu): every step runs eagerly"


# ---- FULL prefill graphs: the rules that leave them out ----------------------------------


def test_full_prefill_graphs_are_kept_by_default_and_with_speculation_or_stages():
    for kw in ({}, SPEC, {"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}):
        for mode in ("full", "full_and_piecewise"):
            res = resolve(config(mode, **kw))
            assert res.plan.prefill_token_sizes[-1] == 2048 and res.plan.prefill_reqs == (1, 4)
            assert not [d for d in res.decisions if "prefill" in d.rule], (mode, kw)


def test_a_decode_only_backend_leaves_out_full_prefill_graphs(decode_only_backend):
    for mode in ("full", "full_and_piecewise"):
        res = resolve(config(mode, decode_only_backend))
        assert res.resolved.value == "full_and_piecewise"
        (rule,) = [d for d in res.decisions if "prefill" in d.rule]
        assert rule.rule == "full_prefill_needs_capturable_attention"
        assert "'decode_only'" in rule.reason and "piecewise graphs" in rule.reason
        assert res.plan.prefill_token_sizes == res.plan.prefill_reqs == ()
        assert res.plan.decode_sizes  # the decode graphs stay


def test_lora_leaves_out_full_prefill_graphs_and_says_how_many():
    res = resolve(config("full_and_piecewise", enable_lora=True, max_loras=4))
    rule = next(d for d in res.decisions if d.rule == "full_prefill_off_with_lora")
    assert "(0, 1, 2, 4)" in rule.reason and "232 graphs" in rule.reason  # 29 x 2 x 4
    assert res.plan.prefill_token_sizes == ()
    runner = GraphRunner(config("full_and_piecewise", enable_lora=True, max_loras=4))
    assert runner.dispatch(500, 1, None) == (PIECEWISE, BatchDescriptor.piecewise(512))
    # only where there are FULL prefill graphs to leave out
    for kw in ({"cuda_graph_mode": "piecewise"}, {"full_prefill_max_tokens": 0}):
        quiet = EngineConfig(device="cuda", enable_lora=True, **kw)
        assert "full_prefill_off_with_lora" not in {d.rule for d in resolve(quiet).decisions}


def test_the_runner_dispatches_with_the_plan_the_rules_left(decode_only_backend):
    runner = GraphRunner(config("full_and_piecewise", decode_only_backend))
    assert runner.dispatch(500, 1, None) == (PIECEWISE, BatchDescriptor.piecewise(512))
    runner = GraphRunner(config("full_and_piecewise"))
    assert runner.dispatch(500, 1, None) == (FULL, BatchDescriptor(512, 1, None))
