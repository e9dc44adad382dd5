"""ostinato bench {latency,throughput,startup,prefill,serve}: time the engine against its floors
(serve, an online benchmark against a server, lives in bench_serve.py)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from ostinato.config import EngineConfig
from ostinato.engine.engine import LLMEngine
from ostinato.engine_args import add_engine_args, async_scheduling, engine_config
from ostinato.footprint import meta_model, step_weight_bytes
from ostinato.loader import load_hf_config
from ostinato.lora.adapter import BaseShapes, write_random_adapter
from ostinato.lora.request import LoRARequest
from ostinato.models.llama import head_dim
from ostinato.models.registry import get_model_class
from ostinato.quantization import resolve_quantization
from ostinato.sampling_params import SamplingParams, StructuredOutputsParams


def add_bench_parser(sub) -> None:
    from ostinato import bench_serve

    bench = sub.add_parser("bench", help="measure latency, throughput, start-up or a server")
    kinds = bench.add_subparsers(dest="bench", required=True)
    for name, help_text in (
        ("latency", "time per output token and time to first token of one batch"),
        ("throughput", "tokens per second over many requests"),
        (
            "startup",
            "load and capture seconds, graph count and memory, time to the first token",
        ),
        ("prefill", "time to first token of one prompt per length, against the compute floor"),
    ):
        p = kinds.add_parser(name, help=help_text)
        p.add_argument("--json", action="store_true", help="print one JSON object per result")
        add_engine_args(p)
        p.set_defaults(func=run_bench)
    kinds.choices["latency"].add_argument(
        "--batch-size", type=_int_list, default=[1], help="comma-separated batch sizes (default 1)"
    )
    kinds.choices["throughput"].add_argument(
        "--batch-size", type=int, default=256, help="requests (default 256)"
    )
    for name, output_len in (("latency", 128), ("throughput", 128), ("startup", 16)):
        p = kinds.choices[name]
        p.add_argument("--input-len", type=int, default=32, help="prompt tokens (default 32)")
        p.add_argument(
            "--output-len",
            type=int,
            default=output_len,
            help=f"output tokens (default {output_len})",
        )
    kinds.choices["prefill"].add_argument(
        "--input-len",
        type=_int_list,
        default=[512, 2048, 8192],
        help="comma-separated prompt lengths, one prompt each (default 512,2048,8192)",
    )
    for name in ("latency", "prefill"):
        kinds.choices[name].add_argument(
            "--iters", type=int, default=3, help="timed runs; the median is reported (default 3)"
        )
    kinds.choices["latency"].add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="random",
        help="random: random prompts, greedy; copy: prompts holding a span the answer repeats, "
        "greedy; norepeat: sampled answers that repeat nothing (default random)",
    )
    kinds.choices["latency"].add_argument(
        "--num-loras",
        type=_count_list,
        default=[0],
        help="comma-separated adapter counts: each batch runs once per count, its requests "
        "spread over that many random LoRA adapters (0: the base model; turns on "
        "--enable-lora; default 0)",
    )
    kinds.choices["latency"].add_argument(
        "--lora-rank", type=int, default=16, help="rank of the random adapters (default 16)"
    )
    kinds.choices["latency"].add_argument(
        "--structured-output",
        type=_structured_list,
        default=["none"],
        help="comma-separated: none, json (every request constrained by one JSON schema, an "
        "array of strings longer than the output); each batch runs once per value, and json "
        "reports the host time of the token bitmask per step (default none)",
    )
    serve = kinds.add_parser("serve", help="Poisson load on an OpenAI-compatible server")
    bench_serve.add_arguments(serve)
    known = set(map(id, serve._actions))
    add_engine_args(serve)  # for --launch; --model is also the name requests give
    engine_actions = [a for a in serve._actions if id(a) not in known]
    serve.set_defaults(func=bench_serve.run, engine_actions=engine_actions)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,8,32, got {text!r}")
    return values


def _count_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected counts like 0,1,4, got {text!r}")
    return values


def _structured_list(text: str) -> list[str]:
    values = [x for x in text.split(",") if x]
    if not values or any(v not in STRUCTURED for v in values):
        raise argparse.ArgumentTypeError(f"expected none and/or json like none,json, got {text!r}")
    return values


def run_bench(args: argparse.Namespace) -> int:
    # --cuda-graph-mode, --cuda-graph-capture and --async-scheduling may list several values:
    # every combination runs, one after another in this process.
    bandwidth = copy_bandwidth() if args.device != "cpu" and torch.cuda.is_available() else None
    if args.bench == "prefill":
        args.max_model_len = _prefill_model_len(args)
    most_loras = max(getattr(args, "num_loras", [0]))
    for mode, capture, overlap in itertools.product(
        args.cuda_graph_mode.split(","),
        args.cuda_graph_capture.split(","),
        args.async_scheduling.split(","),
    ):
        config = engine_config(
            args,
            cuda_graph_mode=mode,
            cuda_graph_capture=capture,
            async_scheduling=async_scheduling(overlap),
        )
        if most_loras:
            loras = max(most_loras, config.max_loras)
            config = dataclasses.replace(config, enable_lora=True, max_loras=loras)
        engine, build_s = _build(config)
        try:
            for result in BENCHES[args.bench](engine, build_s, args, bandwidth):
                shape = {"pp": config.pipeline_parallel_size, "tp": config.tensor_parallel_size}
                head = {"bench": args.bench, "model": config.model, **shape,
                        "async_scheduling": engine.config.async_scheduling}  # fmt: skip
                emit_result({**head, **result}, args.json)
        finally:
            engine.shutdown()  # worker processes, before the next engine starts its own
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


def emit_result(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        print("  ".join(f"{k}={_fmt(v)}" for k, v in result.items()), flush=True)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _build(config: EngineConfig) -> tuple[LLMEngine, float]:
    start = time.perf_counter()
    engine = LLMEngine(config)
    return engine, time.perf_counter() - start


def _prompts(engine: LLMEngine, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    """Random prompts; a new seed per run keeps the prefix cache from serving them."""
    g = torch.Generator().manual_seed(seed)
    vocab = min(engine.vocab_size, 30000)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def _greedy(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def random_workload(engine: LLMEngine, batch: int, input_len: int, output_len: int, seed: int):
    """Random prompts, greedy answers."""
    return _prompts(engine, batch, input_len, seed), _greedy(output_len)


def copy_workload(engine: LLMEngine, batch: int, input_len: int, output_len: int, seed: int):
    """Prompts X + A + X of about input_len tokens, where A (up to output_len tokens, at most
    half the prompt) is the model's own greedy answer to X, made here untimed: the answer to
    the whole prompt repeats the span A, as edits of code or quoted text repeat their source.
    Random weights have no induction heads, but they decode mostly from the last few tokens,
    so their answer after the second X is again A (the acceptance rate reported shows it)."""
    answer_len = max(1, min(output_len, input_len // 2))
    heads = _prompts(engine, batch, max(1, (input_len - answer_len) // 2), seed)
    answers = _generate(engine, heads, _greedy(answer_len))
    return [x + a + x for x, a in zip(heads, answers, strict=True)], _greedy(output_len)


def norepeat_workload(engine: LLMEngine, batch: int, input_len: int, output_len: int, seed: int):
    """Prompts of distinct random tokens, answers sampled at temperature 1: random weights give
    a nearly uniform distribution over the vocabulary, so the answer repeats nothing and
    speculation finds nothing to draft: what it costs when it cannot help."""
    g = torch.Generator().manual_seed(seed)
    vocab = min(engine.vocab_size, 30000)
    prompts = [torch.randperm(vocab, generator=g)[:input_len].tolist() for _ in range(batch)]
    return prompts, SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)


WORKLOADS = {"random": random_workload, "copy": copy_workload, "norepeat": norepeat_workload}
SPEC_COUNTERS = ("spec_draft_tokens", "spec_accepted_tokens")
MASK_COUNTERS = ("structured_mask_steps", "structured_mask_seconds")
STRUCTURED = ("none", "json")


def _constrained(workload: Callable, structured: str) -> Callable:
    """workload with every request constrained by one JSON schema (structured "json"): an
    array of at least output_len strings, which no answer of output_len tokens completes, so
    every request runs its whole length."""
    if structured == "none":
        return workload

    def constrained(engine, batch, input_len, output_len, seed):
        prompts, params = workload(engine, batch, input_len, output_len, seed)
        schema = {"type": "array", "items": {"type": "string"}, "minItems": output_len}
        so = StructuredOutputsParams(json=schema)
        return prompts, dataclasses.replace(params, structured_outputs=so)

    return constrained


def _generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams):
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    return [done[i] for i in ids]


def _sync(engine: LLMEngine) -> None:
    if engine.config.is_cuda:
        torch.cuda.synchronize()


def _timed_run(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    adapters: list[LoRARequest] | None = None,
) -> tuple[float, float]:
    """Seconds to the first token of every request, and seconds per output token after it
    (a step may append several tokens when it verifies drafts). Requests take the adapters
    in turn (none without)."""
    for i, p in enumerate(prompts):
        lora = adapters[i % len(adapters)] if adapters else None
        engine.add_request(p, params, lora_request=lora)
    _sync(engine)
    start = time.perf_counter()
    first_done = None
    started: set[str] = set()
    most_tokens = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        most_tokens = max([most_tokens, *(len(o.token_ids) for o in outs)])
        if first_done is None:
            started.update(o.request_id for o in outs)
            if len(started) == len(prompts):
                _sync(engine)
                first_done = time.perf_counter()
    _sync(engine)
    end = time.perf_counter()
    return first_done - start, (end - first_done) / max(most_tokens - 1, 1)


def bench_latency(engine: LLMEngine, build_s: float, args, bandwidth: float | None) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="ostinato-lora-") as root:
        adapters = random_adapters(engine, max(args.num_loras), args.lora_rank, root)
        results = [
            _latency(engine, args, bandwidth, batch, adapters[:n], structured)
            for batch in args.batch_size
            for n in args.num_loras
            for structured in getattr(args, "structured_output", ["none"])
        ]
    results[-1]["steps"] = engine.graph_report()["steps"]
    return results


def random_adapters(engine: LLMEngine, count: int, rank: int, root: str) -> list[LoRARequest]:
    base = BaseShapes.of(engine.hf_config) if count else None
    dtype = engine.config.torch_dtype
    return [
        LoRARequest(f"lora{i}", str(write_random_adapter(f"{root}/{i}", base, rank, i, dtype)))
        for i in range(count)
    ]


def _latency(
    engine: LLMEngine,
    args,
    bandwidth: float | None,
    batch: int,
    adapters,
    structured: str = "none",
) -> dict:
    """One batch size with its requests spread over `adapters` (and constrained by a JSON
    schema with structured "json"): the medians of args.iters runs' TTFT and TPOT after a
    warm-up run (which also copies the adapters into their slots and compiles the grammar)."""
    config = engine.config
    workload = _constrained(WORKLOADS[getattr(args, "workload", "random")], structured)
    # Seeds unique per (batch size, adapters, run): no run's prompts prefix another's.
    seeds = [batch * 1000 + len(adapters) * 100 + i for i in range(args.iters + 1)]
    warm = workload(engine, batch, args.input_len, min(args.output_len, 8), seeds[0])
    _timed_run(engine, *warm, adapters)
    runs, drafts = [], dict.fromkeys((*SPEC_COUNTERS, *MASK_COUNTERS), 0)
    for seed in seeds[1:]:
        prompts, params = workload(engine, batch, args.input_len, args.output_len, seed)
        before = engine.stats()  # the timed runs' drafts only, not the workload's own
        runs.append(_timed_run(engine, prompts, params, adapters))
        for key in drafts:
            drafts[key] += engine.stats()[key] - before[key]
    # each its own median: the run of the median TTFT may be the one whose decode a host
    # stall slowed (qwen3-0.6b batch 1 on the H200: 1.20 against 0.80 ms, s42)
    ttfts, tpots = zip(*runs, strict=True)
    ttft, tpot = statistics.median(ttfts), statistics.median(tpots)
    result = {
        "mode": engine.graph_report()["cuda_graph_mode"],
        "requested_mode": config.cuda_graph_mode,
        "workload": getattr(args, "workload", "random"),
        "speculative_method": config.speculative_method,
        "num_speculative_tokens": config.num_speculative_tokens,
        "quantization": config.quantization,
        "batch_size": batch,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "tpot_ms": tpot * 1e3,
        "ttft_ms": ttft * 1e3,
    }
    if config.enable_lora:
        result.update(num_loras=len(adapters), lora_rank=args.lora_rank)
    if structured != "none":
        steps = max(drafts["structured_mask_steps"], 1)
        result.update(
            structured_output=structured,
            mask_ms_per_step=drafts["structured_mask_seconds"] / steps * 1e3,
        )
    if config.speculative_method is not None:
        accepted, drafted = drafts["spec_accepted_tokens"], drafts["spec_draft_tokens"]
        result.update(drafts, spec_acceptance_rate=accepted / max(drafted, 1))
    if bandwidth:
        floor = decode_floor_bytes(engine, batch, args.input_len + args.output_len // 2)
        result.update(
            copy_bandwidth_gbs=bandwidth / 1e9,
            floor_ms=floor / bandwidth * 1e3,
            ratio_to_floor=tpot / (floor / bandwidth),
        )
    return result


def bench_throughput(
    engine: LLMEngine, build_s: float, args, bandwidth: float | None
) -> list[dict]:
    _timed_run(engine, _prompts(engine, 2, args.input_len), _greedy(4))
    prompts = _prompts(engine, args.batch_size, args.input_len, seed=1)
    _sync(engine)
    start = time.perf_counter()
    _timed_run(engine, prompts, _greedy(args.output_len))
    seconds = time.perf_counter() - start
    total_out = args.batch_size * args.output_len
    return [
        {
            "mode": engine.graph_report()["cuda_graph_mode"],
            "requests": args.batch_size,
            "seconds": seconds,
            "output_tokens_per_s": total_out / seconds,
            "total_tokens_per_s": (total_out + args.batch_size * args.input_len) / seconds,
        }
    ]


def bench_startup(engine: LLMEngine, build_s: float, args, bandwidth: float | None) -> list[dict]:
    """Start-up, then one request: its time to first token and to its last token (lazy
    capture pays for its graphs here instead of at start-up)."""
    report = engine.graph_report()
    capture_s, num_graphs = report["capture_seconds"], _num_graphs(report)
    warm_up_s = report["eager_warm_up_seconds"]
    ttft, request_s = _first_request(engine, _prompts(engine, 1, args.input_len)[0], args)
    after = engine.graph_report()
    return [
        {
            "mode": report["cuda_graph_mode"],
            "capture": engine.config.cuda_graph_capture,
            "startup_s": build_s,
            "load_s": build_s - capture_s - warm_up_s,
            **{f"{phase}_s": s for phase, s in report["start_up_seconds"].items()},
            "capture_s": capture_s,
            "warm_up_s": warm_up_s,
            "num_graphs": num_graphs,
            "graph_memory_gib": report["graph_memory_bytes"] / 2**30,
            "graph_memory_budget_gib": report.get("graph_memory_budget_bytes", 0) / 2**30,
            "warmups": report["warmups"],
            "kv_blocks": engine.runner.num_blocks,
            "ttft_after_start_s": ttft,
            "first_token_after_load_s": capture_s + ttft,
            "first_request_s": request_s,
            "graphs_after_first_request": _num_graphs(after),
            "capture_s_after_first_request": after["capture_seconds"],
        }
    ]


def _num_graphs(report: dict) -> int:
    return sum(len(v) for v in report["captured"].values())


def _first_request(engine: LLMEngine, prompt: list[int], args) -> tuple[float, float]:
    """Seconds from adding one request to its first token, and to its last."""
    params = _greedy(args.output_len)
    start = time.perf_counter()
    engine.add_request(prompt, params)
    first = None
    while engine.has_unfinished_requests():
        if engine.step() and first is None:
            first = time.perf_counter() - start
    return first, time.perf_counter() - start


def bench_prefill(engine: LLMEngine, build_s: float, args, bandwidth: float | None) -> list[dict]:
    """Per prompt length: the median time to the first token of one fresh prompt (prefill,
    chunked when longer than max_num_batched_tokens, then one sampled token) after an untimed
    run of the same length, and its ratio to the compute floor: 2 x parameters x tokens at the
    matmul rate measured here (CUDA only; on a CPU the floor fields are null)."""
    rate = matmul_rate(engine.config.torch_dtype) if engine.config.is_cuda else None
    params = num_parameters(engine)
    results = []
    for i, length in enumerate(args.input_len):
        seeds = [10_000 * (i + 1) + run for run in range(args.iters + 1)]
        steps_before = engine.graph_report()["steps"]
        ttfts = [_first_token_s(engine, _prompts(engine, 1, length, seed)[0]) for seed in seeds]
        steps_after = engine.graph_report()["steps"]
        ttft = statistics.median(ttfts[1:])
        floor = 2 * params * length / rate if rate else None
        results.append(
            {
                "mode": engine.graph_report()["cuda_graph_mode"],
                "requested_mode": engine.config.cuda_graph_mode,
                "input_len": length,
                "ttft_ms": ttft * 1e3,
                "prefill_tokens_per_s": length / ttft,
                "parameters": params,
                "matmul_tflops": rate / 1e12 if rate else None,
                "floor_ms": floor * 1e3 if floor else None,
                "ratio_to_floor": ttft / floor if floor else None,
                # steps per runtime mode over the warm-up and timed runs of this length
                "steps": {m: steps_after[m] - steps_before[m] for m in steps_after},
            }
        )
    return results


def _prefill_model_len(args) -> int:
    """max_model_len for bench prefill: room for the longest prompt and its token."""
    need = max(args.input_len) + 1
    if args.max_model_len is not None:
        if need > args.max_model_len:
            raise ValueError(
                f"--input-len {need - 1} does not fit --max-model-len {args.max_model_len}: "
                "raise --max-model-len or give shorter prompt lengths"
            )
        return args.max_model_len
    limit = getattr(load_hf_config(args.model), "max_position_embeddings", None)
    if limit is not None and need > limit:
        raise ValueError(
            f"--input-len {need - 1} does not fit {args.model}'s context of {limit} tokens: "
            "give shorter prompt lengths (e.g. --input-len 512,2048)"
        )
    return need


def _first_token_s(engine: LLMEngine, prompt: list[int]) -> float:
    _sync(engine)
    start = time.perf_counter()
    engine.add_request(prompt, _greedy(1))
    while engine.has_unfinished_requests():
        engine.step()
    _sync(engine)
    return time.perf_counter() - start


def num_parameters(engine: LLMEngine) -> int:
    """Parameters of the whole model (every stage and tensor slice), embedding included."""
    c = engine.hf_config
    with torch.device("meta"):  # shapes only
        model = get_model_class(c)(c)
    return sum(p.numel() for p in model.parameters())


def matmul_rate(dtype: torch.dtype, n: int = 8192) -> float:
    """FLOP/s of an n x n x n matmul in dtype on the current GPU (median of 10)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * n**3 / statistics.median(times)


BENCHES = {
    "latency": bench_latency,
    "throughput": bench_throughput,
    "startup": bench_startup,
    "prefill": bench_prefill,
}


def decode_floor_bytes(engine: LLMEngine, batch: int, context: int) -> int:
    """Bytes one decode step must read: every weight once at its stored width (FP8 weights one
    byte, with their scales), of a mixture-of-experts layer only the experts the batch is
    expected to choose, plus the KV of every request, over the whole model (every pipeline
    stage and tensor slice together)."""
    c, itemsize = engine.hf_config, engine.config.torch_dtype.itemsize
    spec = resolve_quantization(engine.config.quantization, c)
    weights = step_weight_bytes(meta_model(c, engine.config.torch_dtype, spec), batch)
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim(c) * itemsize
    return weights + batch * context * kv_per_token


def copy_bandwidth(num_bytes: int = 2**30) -> float:
    """Device-to-device copy rate in bytes per second, counting bytes read plus written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * num_bytes / sorted(times)[len(times) // 2]
