"""The bench commands on CPU: they run, report what they claim, and measure fresh prompts."""

import argparse
import json
from functools import partial
from types import SimpleNamespace

import pytest

import ostinato.bench as bench
from ostinato.cli import main
from ostinato.config import EngineConfig
from ostinato.loader import load_hf_config
from ostinato.models.llama import head_dim


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


def fake_runs(monkeypatch, engine, runs, per_run):
    """bench._timed_run gives `runs` in turn (the warm-up first), and each run adds per_run to
    the engine's counters (engine.stats), as drafts and grammar masks would."""
    runs, done = iter(runs), [0]

    def timed_run(*args):
        done[0] += 1
        return next(runs)

    stats = engine.stats
    monkeypatch.setattr(bench, "_timed_run", timed_run)
    monkeypatch.setattr(
        engine, "stats", lambda: stats() | {k: v * done[0] for k, v in per_run.items()}
    )


def test_latency_reports_its_floor_and_counters_from_the_timed_runs_only(monkeypatch):
    """With a copy bandwidth, the floor is the bytes of a decode step at the runs' mean
    context (prompt + half the output) over that bandwidth, and the ratio is TPOT over it.
    Drafts and grammar masks count the timed runs, not the warm-up: the acceptance rate is
    accepted over drafted, the mask's time a step their seconds over their steps."""
    engine, seconds = bench._build(
        EngineConfig(device="cpu", speculative_method="ngram", num_speculative_tokens=2)
    )
    per_run = dict(spec_draft_tokens=8, spec_accepted_tokens=6, structured_mask_steps=4,
                   structured_mask_seconds=0.002)  # fmt: skip
    runs = [(1.0, 1.0), (0.010, 0.004), (0.020, 0.006), (0.030, 0.005)]
    fake_runs(monkeypatch, engine, runs, per_run)
    args = argparse.Namespace(input_len=8, output_len=5, iters=3, lora_rank=16)
    bandwidth = 2e9
    result = bench._latency(engine, args, bandwidth, 1, [], "json")
    floor_s = bench.decode_floor_bytes(engine, 1, 8 + 2) / bandwidth
    assert bench.decode_floor_bytes(engine, 1, 10) > bench.decode_floor_bytes(engine, 1, 9)
    assert result["copy_bandwidth_gbs"] == pytest.approx(2.0)
    assert result["floor_ms"] == pytest.approx(floor_s * 1e3)
    assert result["ratio_to_floor"] == pytest.approx(0.005 / floor_s)
    assert result["spec_draft_tokens"] == 24 and result["spec_accepted_tokens"] == 18
    assert result["spec_acceptance_rate"] == pytest.approx(0.75)
    assert result["mask_ms_per_step"] == pytest.approx(0.5)
    assert result["structured_output"] == "json"
    assert (result["workload"], result["speculative_method"]) == ("random", "ngram")
    assert (result["input_len"], result["output_len"], result["quantization"]) == (8, 5, None)


def test_startup_splits_its_seconds_and_reports_the_graphs_before_and_after(monkeypatch):
    """bench startup's fields from the engine's graph report (faked) and the first request:
    load is start-up less capture and eager warm-up; the first token after load adds the
    capture; graph memory in GiB (a budget of 0 where the report has none); the graphs and
    capture seconds after the first request from the report then."""
    engine, _ = bench._build(EngineConfig(device="cpu"))
    before = dict(cuda_graph_mode="full_and_piecewise", capture_seconds=2.0,
                  eager_warm_up_seconds=0.5, start_up_seconds={"weights": 1.0},
                  graph_memory_bytes=3 * 2**30, graph_memory_budget_bytes=2**31, warmups=4,
                  captured={"full": [1, 2], "piecewise": [1]})  # fmt: skip
    after = before | dict(capture_seconds=3.5, captured={"full": [1, 2, 4], "piecewise": [1]})
    for budget in (True, False):
        reports = iter([before, after] if budget else
                       [{k: v for k, v in r.items() if k != "graph_memory_budget_bytes"}
                        for r in (before, after)])  # fmt: skip
        monkeypatch.setattr(engine, "graph_report", lambda reports=reports: next(reports))
        monkeypatch.setattr(bench, "_first_request", lambda *a: (0.25, 1.5))
        (r,) = bench.bench_startup(engine, 10.0, argparse.Namespace(input_len=8), None)
        assert r == dict(
            mode="full_and_piecewise", capture=engine.config.cuda_graph_capture, startup_s=10.0,
            load_s=7.5, weights_s=1.0, capture_s=2.0, warm_up_s=0.5, num_graphs=3,
            graph_memory_gib=3.0, graph_memory_budget_gib=2.0 if budget else 0.0, warmups=4,
            kv_blocks=engine.runner.num_blocks, ttft_after_start_s=0.25,
            first_token_after_load_s=2.25, first_request_s=1.5, graphs_after_first_request=4,
            capture_s_after_first_request=3.5,
        )  # fmt: skip


def test_first_token_and_request_times_follow_a_fake_clock(monkeypatch):
    """Each engine step takes 10 ms on a clock that does not start at 0: one request's first
    token comes after its first step, its last after its last (3 tokens, 3 steps); a fresh
    prompt's first token alone takes one step."""
    clock = [5.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    engine, _ = bench._build(EngineConfig(device="cpu"))
    step = engine.step

    def timed_step():
        clock[0] += 0.010
        return step()

    monkeypatch.setattr(engine, "step", timed_step)
    prompt = bench._prompts(engine, 1, 8)[0]
    first, total = bench._first_request(engine, prompt, argparse.Namespace(output_len=3))
    assert (first, total) == (pytest.approx(0.010), pytest.approx(0.030))
    assert bench._first_token_s(engine, bench._prompts(engine, 1, 8, seed=1)[0]) == (
        pytest.approx(0.010)
    )


def test_prefill_reports_the_median_after_the_warm_up_and_its_compute_floor(monkeypatch):
    """With a matmul rate (CUDA only; faked here), a prompt length's floor is 2 x parameters
    x tokens over that rate; TTFT is the median of the timed runs, the untimed first excluded,
    and the prefill rate is tokens over it."""
    monkeypatch.setattr(bench, "matmul_rate", lambda dtype: 4e12)
    times = iter([9.0, 0.010, 0.030, 0.020])
    monkeypatch.setattr(bench, "_first_token_s", lambda *a: next(times))
    engine, _ = bench._build(EngineConfig(device="cpu"))
    monkeypatch.setattr(EngineConfig, "is_cuda", property(lambda self: True))
    args = argparse.Namespace(input_len=[16], iters=3)
    (r,) = bench.bench_prefill(engine, 0.0, args, None)
    floor_s = 2 * bench.num_parameters(engine) * 16 / 4e12
    assert r["ttft_ms"] == pytest.approx(20.0) and r["prefill_tokens_per_s"] == pytest.approx(800)
    assert r["matmul_tflops"] == pytest.approx(4.0) and r["mode"] == "none"
    assert r["floor_ms"] == pytest.approx(floor_s * 1e3)
    assert r["ratio_to_floor"] == pytest.approx(0.020 / floor_s)


@pytest.mark.parametrize(
    "lengths, max_model_len, want",
    [
        ([63], 64, 64),
        ([64], 64, "--input-len 64 does not fit --max-model-len 64: raise --max-model-len or "
                    "give shorter prompt lengths"),
        ([8, 4095], None, 4096),
        ([4096, 8], None, "--input-len 4096 does not fit random:tiny's context of 4096 tokens: "
                          "give shorter prompt lengths (e.g. --input-len 512,2048)"),
    ],
)  # fmt: skip
def test_prefill_sizes_the_context_to_its_longest_prompt_and_its_token(lengths, max_model_len,
                                                                        want):  # fmt: skip
    """bench prefill's max_model_len: the longest prompt and the one token it samples, within
    --max-model-len where given, else within the model's positions (tiny's 4,096)."""
    args = argparse.Namespace(input_len=lengths, max_model_len=max_model_len, model="random:tiny")
    if isinstance(want, int):
        assert bench._prefill_model_len(args) == want
        return
    with pytest.raises(ValueError) as error:
        bench._prefill_model_len(args)
    assert str(error.value) == want


@pytest.mark.parametrize("model", ["tiny", "random:tiny-moe"])
def test_the_decode_floor_counts_every_requests_kv_and_the_weights_as_stored(model):
    """A decode step's floor: the KV of every request's context (2 x layers x KV heads x
    head_dim x the dtype's bytes a token), plus the weights at their stored width (FP8 at load
    reads fewer bytes) of which a mixture of experts reads more as the batch chooses more
    experts; a dense model reads every weight at any batch."""
    hf = load_hf_config(model)
    engines = {
        q: SimpleNamespace(
            hf_config=hf,
            config=EngineConfig(model=model, device="cpu", dtype="bfloat16", quantization=q),
        )
        for q in (None, "fp8")
    }
    floor = partial(bench.decode_floor_bytes, engines[None])
    kv = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim(hf) * 2
    assert floor(3, 11) - floor(3, 10) == 3 * kv and floor(3, 10) - floor(3, 0) == 30 * kv
    if model == "tiny":
        assert floor(32, 0) == floor(1, 0)
        assert 0 < bench.decode_floor_bytes(engines["fp8"], 1, 0) < floor(1, 0)
    else:
        assert floor(32, 0) > floor(1, 0)


def test_requests_take_the_adapters_in_turn_in_every_run(monkeypatch):
    """_timed_run gives request i adapter i mod the count (none without adapters), and
    _latency hands its adapters to the warm-up and to every timed run."""
    engine, _ = bench._build(EngineConfig(device="cpu"))
    taken, add = [], engine.add_request
    monkeypatch.setattr(  # the adapter noted, the request run without it (no LoRA here)
        engine,
        "add_request",
        lambda p, params, lora_request: taken.append(lora_request) or add(p, params),
    )
    bench._timed_run(engine, bench._prompts(engine, 3, 8), bench._greedy(2), ["a", "b"])
    assert taken == ["a", "b", "a"]
    given = []
    monkeypatch.setattr(bench, "_timed_run", lambda *a: given.append(a[3]) or (0.01, 0.01))
    args = argparse.Namespace(input_len=8, output_len=4, iters=2, lora_rank=16)
    bench._latency(engine, args, None, 1, ["a", "b"])
    assert given == [["a", "b"]] * 3
