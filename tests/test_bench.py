"""The bench commands on CPU: they run, report what they claim, and measure fresh prompts."""

import argparse
import json

import pytest

import ostinato.bench as bench
from ostinato.cli import main
from ostinato.config import EngineConfig


def test_latency_runs_never_hit_the_prefix_cache():
    engine, seconds = bench._build(EngineConfig(device="cpu"))
    args = argparse.Namespace(
        batch_size=[1, 4], input_len=40, output_len=3, iters=2, num_loras=[0], lora_rank=16
    )
    results = bench.bench_latency(engine, seconds, args, None)
    assert [r["batch_size"] for r in results] == [1, 4]
    assert all(r["tpot_ms"] > 0 and r["ttft_ms"] > 0 for r in results)
    assert engine.stats()["prefix_cache_hits"] == 0


def test_cli_bench_json_lines(capsys):
    argv = ["bench", "latency", "--batch-size", "2", "--output-len", "3", "--iters", "1"]
    assert main([*argv, "--device", "cpu", "--json", "--cuda-graph-mode", "none,piecewise"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["requested_mode"] for r in lines] == ["none", "piecewise"]
    assert all(r["mode"] == "none" for r in lines)  # CPU: graphs resolve to none
    argv = ["bench", "startup", "--device", "cpu", "--json", "--output-len", "3"]
    assert main([*argv, "--cuda-graph-capture", "eager,lazy"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["capture"] for r in lines] == ["eager", "lazy"]
    for r in lines:
        assert r["num_graphs"] == r["graphs_after_first_request"] == 0 and r["load_s"] > 0
        phases = r["weights_s"] + r["kv_sizing_s"] + r["kv_cache_s"]  # the runner's own
        assert r["weights_s"] > 0 and phases < r["load_s"]
        assert r["warm_up_s"] == 0  # the eager warm-up compiles GPU kernels only
        assert 0 < r["ttft_after_start_s"] < r["first_request_s"]


def test_latency_with_async_scheduling_on_and_off(capsys):
    argv = ["bench", "latency", "--device", "cpu", "--json", "--output-len", "3", "--iters", "1"]
    assert main([*argv, "--async-scheduling", "on,off"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["async_scheduling"] for r in lines] == [True, False]
    assert main([*argv, "--async-scheduling", "on,sometimes"]) == 2
    assert "'auto', 'on' or 'off'" in capsys.readouterr().err


def test_bad_batch_sizes_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "latency", "--batch-size", "0,4", "--device", "cpu"])
    assert exit_info.value.code == 2
    assert "positive integers" in capsys.readouterr().err


def test_copy_workload_prompts_repeat_the_models_own_answer():
    engine = bench.LLMEngine(EngineConfig(device="cpu"))
    prompts, params = bench.copy_workload(engine, 2, 40, 8, seed=3)
    head = (40 - 8) // 2
    for prompt in prompts:
        x, a = prompt[:head], prompt[head : head + 8]
        assert prompt == x + a + x and len(prompt) == 40
        greedy = bench.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        assert bench._generate(engine, [x], greedy) == [a]
    assert params.temperature == 0.0 and params.max_tokens == 8


def test_latency_with_speculation_reports_acceptance(capsys):
    argv = ["bench", "latency", "--device", "cpu", "--json", "--batch-size", "1"]
    argv += ["--input-len", "24", "--output-len", "6", "--iters", "1", "--workload", "copy"]
    assert main([*argv, "--speculative-method", "ngram", "--num-speculative-tokens", "3"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["workload"], result["num_speculative_tokens"]) == ("copy", 3)
    assert result["spec_draft_tokens"] > 0 and result["spec_acceptance_rate"] > 0.5
    assert result["tpot_ms"] > 0


def test_latency_with_random_adapters_per_count(capsys):
    argv = ["bench", "latency", "--batch-size", "1,3", "--output-len", "3", "--iters", "1"]
    argv += ["--num-loras", "0,2", "--lora-rank", "4", "--json"]
    assert main([*argv, "--device", "cpu", "--max-lora-rank", "8"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["batch_size"], r["num_loras"]) for r in lines] == [(1, 0), (1, 2), (3, 0), (3, 2)]
    assert all(r["lora_rank"] == 4 and r["tpot_ms"] > 0 for r in lines)


def test_latency_constrained_by_a_json_schema(capsys):
    argv = ["bench", "latency", "--batch-size", "2", "--output-len", "5", "--iters", "1"]
    assert main([*argv, "--structured-output", "none,json", "--device", "cpu", "--json"]) == 0
    free, constrained = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert "mask_ms_per_step" not in free
    assert constrained["structured_output"] == "json" and constrained["mask_ms_per_step"] > 0
    with pytest.raises(SystemExit):
        main([*argv, "--structured-output", "yaml"])


def test_bench_prefill_one_fresh_prompt_per_length(capsys):
    """One line per prompt length and mode; a prompt longer than the step budget is chunked
    (3 steps of at most 16 tokens for 40), each run is a fresh prompt (no prefix-cache hit:
    a hit would leave fewer steps), and on a CPU the compute floor is null."""
    argv = ["bench", "prefill", "--device", "cpu", "--json", "--input-len", "8,40", "--iters"]
    argv += ["2", "--max-num-batched-tokens", "16", "--cuda-graph-mode", "none,piecewise"]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["requested_mode"], r["input_len"]) for r in lines] == [
        ("none", 8), ("none", 40), ("piecewise", 8), ("piecewise", 40)
    ]  # fmt: skip
    for r in lines:
        assert r["bench"] == "prefill" and r["ttft_ms"] > 0
        assert r["prefill_tokens_per_s"] == pytest.approx(r["input_len"] / r["ttft_ms"] * 1e3)
        assert r["floor_ms"] is r["ratio_to_floor"] is r["matmul_tflops"] is None
        assert r["parameters"] > 10**6  # tiny: about a million
        steps_per_run = -(-r["input_len"] // 16)
        assert r["steps"] == {"none": 3 * steps_per_run, "piecewise": 0, "full": 0}


def test_bench_prefill_refuses_prompts_that_do_not_fit(capsys):
    assert main(["bench", "prefill", "--device", "cpu"]) == 2  # 8192 > tiny's 4096 positions
    assert "give shorter prompt lengths" in capsys.readouterr().err
    argv = ["bench", "prefill", "--device", "cpu", "--input-len", "64", "--max-model-len", "64"]
    assert main(argv) == 2
    assert "raise --max-model-len" in capsys.readouterr().err


def test_latency_numbers_follow_a_fake_clock(monkeypatch):
    """Each engine step takes exactly 10 ms on a fake clock: a batch of 40-token prompts
    prefills in one step (its first tokens: TTFT 10 ms), then decodes 4 more tokens, one step
    each (TPOT 10 ms); with 60-token chunks, 2 prefill steps make TTFT 20 ms."""
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    for budget, ttft in ((8192, 10.0), (64, 20.0)):
        engine, seconds = bench._build(EngineConfig(device="cpu", max_num_batched_tokens=budget))
        step = engine.step

        def timed_step(step=step):
            clock[0] += 0.010
            return step()

        monkeypatch.setattr(engine, "step", timed_step)
        args = argparse.Namespace(
            batch_size=[1, 3], input_len=40, output_len=5, iters=2, num_loras=[0], lora_rank=16
        )
        for r in bench.bench_latency(engine, seconds, args, None):
            assert r["ttft_ms"] == pytest.approx(ttft if r["batch_size"] == 3 else 10.0)
            assert r["tpot_ms"] == pytest.approx(10.0)


def test_latency_reports_the_median_of_each_number(monkeypatch):
    """TTFT and TPOT are each their own median over the timed runs: the run with the median
    TTFT (20 ms) is the one with an outlying TPOT (30 ms), which must not be reported."""
    runs = iter([(1.0, 1.0), (0.010, 0.010), (0.020, 0.030), (0.030, 0.011)])  # warm-up first
    monkeypatch.setattr(bench, "_timed_run", lambda *args: next(runs))
    engine, seconds = bench._build(EngineConfig(device="cpu"))
    args = argparse.Namespace(batch_size=[1], input_len=8, output_len=4, iters=3, num_loras=[0],
                              lora_rank=16)  # fmt: skip
    (result,) = bench.bench_latency(engine, seconds, args, None)
    assert result["ttft_ms"] == pytest.approx(20.0)
    assert result["tpot_ms"] == pytest.approx(11.0)
