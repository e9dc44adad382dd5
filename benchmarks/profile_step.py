"""Where a step's time goes, per graph mode: decode time per output token, the step's phases,
the kernels each decoder layer launches, the cost of one eager attention call (the piece a
PIECEWISE graph runs between its segments) and a mixed step (a prefill chunk beside decodes).

    PYTHONPATH=. python3 benchmarks/profile_step.py --model random:qwen3-0.6b \
        --modes none,piecewise,full_and_piecewise --batch-sizes 1,32 --json out.jsonl

Each result is one JSON line (--json appends them to a file) and a line of the table printed
at the end. Prompts are 512 random tokens, unique per request, so the prefix cache serves none.
With --num-loras N, the engine has LoRA on and the decode requests take N random adapters of
--lora-rank in turn (as `ostinato bench latency --num-loras` does).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib
import json
import pstats
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable

import torch
from torch.profiler import record_function

from ostinato.bench import copy_bandwidth, decode_floor_bytes, random_adapters
from ostinato.config import EngineConfig
from ostinato.context import forward_context
from ostinato.engine.engine import LLMEngine
from ostinato.graphs.modes import CudaGraphMode
from ostinato.lora.request import LoRARequest
from ostinato.sampling_params import SamplingParams

PROMPT = 512
_seed = iter(range(10**9))
_adapters: list[LoRARequest] = []  # the profiled engine's (--num-loras), taken in turn


def sync() -> None:
    if torch.cuda.is_available():  # the host section also profiles a CPU engine
        torch.cuda.synchronize()


def prompts(engine: LLMEngine, count: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(next(_seed))
    return torch.randint(100, min(engine.vocab_size, 30000), (count, length), generator=g).tolist()


def start_decoding(engine: LLMEngine, batch: int, max_tokens: int) -> None:
    """batch requests past their prefill, each with a sampled token."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = {
        engine.add_request(
            p, params, lora_request=_adapters[i % len(_adapters)] if _adapters else None
        )
        for i, p in enumerate(prompts(engine, batch, PROMPT))
    }
    started: set[str] = set()
    while not ids <= started:
        started.update(o.request_id for o in engine.step())


def finish(engine: LLMEngine) -> None:
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def decode_ms(engine: LLMEngine, batch: int, steps: int) -> float:
    """Milliseconds per decode step of `batch` requests (one output token each)."""
    start_decoding(engine, batch, steps + 20)
    for _ in range(3):
        engine.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    ms = (time.perf_counter() - t0) / steps * 1e3
    finish(engine)
    return ms


def phases(engine: LLMEngine, batch: int, steps: int) -> dict:
    """Decode steps cut into prepare (host arrays + copies), forward (graph replay, PIECEWISE
    segments and breaks, or eager) and logits + sampling, each closed by a device sync."""
    start_decoding(engine, batch, steps + 20)
    runner = engine.runner
    totals = Counter()
    mode = None
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        sched = engine.scheduler.schedule()
        step = runner.build_step(sched)
        runner.buffers.load(step)
        sync()
        t1 = time.perf_counter()
        out = forward(runner, step)
        sync()
        t2 = time.perf_counter()
        sampled = runner.sampler(runner._logits(out, 0, len(step.logits_indices)), step.sampling)
        t3 = time.perf_counter()
        engine.scheduler.complete(sched)
        seqs = {seq.request_id: seq for seq in sched.seqs}
        for row, tokens in zip(step.sampling, sampled.token_ids, strict=True):
            engine._append_tokens(seqs[row.request_id], tokens, None)
        totals.update(prepare=t1 - t0, forward=t2 - t1, sample=t3 - t2)
        mode = step.mode.value
    finish(engine)
    return {"step_mode": mode, **{k: v / steps * 1e3 for k, v in totals.items()}}


def forward(runner, step):
    ctx = runner._context(step.padded_tokens, step.padded_reqs, step.desc)
    with forward_context(ctx):
        return runner.graphs.run(
            step.mode, step.desc, step.num_tokens, lambda: runner._model_forward(step.padded_tokens)
        )


def host_profile(engine: LLMEngine, batch: int, steps: int, top: int = 40) -> dict:
    """Where the host time of decode steps goes: cProfile over `steps` engine steps, the
    functions with the most own time (file:line function, calls, own ms and cumulative ms per
    step)."""
    start_decoding(engine, batch, steps + 20)
    for _ in range(3):
        engine.step()
    sync()
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    sync()
    ms = (time.perf_counter() - t0) / steps * 1e3
    finish(engine)
    return {"step_ms_profiled": ms, "top": top_functions(profiler, steps, top)}


def top_functions(profiler: cProfile.Profile, steps: int, top: int) -> list[str]:
    """The functions with the most own time: file:line function, calls, own and cumulative ms,
    each per step."""
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [
        f"{f.rsplit('/', 2)[-1] if '/' in f else f}:{line} {name} calls/step="
        f"{nc / steps:.1f} own_ms={tt / steps * 1e3:.3f} cum_ms={ct / steps * 1e3:.3f}"
        for (f, line, name), (_, nc, tt, ct, _) in rows
    ]


def one_decode_step(engine: LLMEngine, batch: int):
    """A decode step of `batch` requests loaded into the buffers; it may run any number of
    times (it rewrites the same KV slots), and is handed back unrun."""
    start_decoding(engine, batch, 1000)
    sched = engine.scheduler.schedule()
    step = engine.runner.build_step(sched, engine.lora)  # the requests' adapters, as step() does
    for load in step.lora_loads:
        engine.runner.lora.load(load.slot, load.path)
    engine.runner.buffers.load(step)
    engine.scheduler.complete(sched, ran=False)
    sync()
    return step


def device_kernels(prof, copies: bool) -> tuple[Counter[str], Counter[str]]:
    """(count, device µs) of each kernel the profiler saw, by name; copies and memsets too
    with copies. Not the device's copy of the profiled step's range (STEP), which spans them."""
    names: Counter[str] = Counter()
    device_us: Counter[str] = Counter()
    for e in prof.events():
        kept = (copies or not e.name.startswith("Mem")) and e.name != STEP
        if e.device_type == torch.autograd.DeviceType.CUDA and kept:
            names[e.name[:60]] += 1
            device_us[e.name[:60]] += e.device_time
    return names, device_us


def kernels(engine: LLMEngine, batch: int) -> dict:
    """Kernels one decode step launches, by name, counted by the profiler over its forward."""
    step = one_decode_step(engine, batch)
    forward(engine.runner, step)
    sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        forward(engine.runner, step)
        sync()
    names, device_us = device_kernels(prof, copies=False)
    layers = engine.hf_config.num_hidden_layers
    finish(engine)
    return {
        "step_mode": step.mode.value,
        "kernels": sum(names.values()),
        "per_layer": sum(names.values()) / layers,
        "device_ms": sum(device_us.values()) / 1e3,
        "us_per_kernel": sum(device_us.values()) / max(1, sum(names.values())),
        "by_name": {n: [c, round(device_us[n], 1)] for n, c in names.most_common()},
    }


def forward_timeline(engine: LLMEngine, batch: int) -> dict:
    """One decode forward profiled on host and device: step_timeline's split of its wall time,
    and the device's idle gaps summed by the activity that ends each (whether the device
    waits on the host, and where: after a graph segment, before an eager launch)."""
    step = one_decode_step(engine, batch)
    forward(engine.runner, step)
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        torch.ones(1, device=engine.config.device).add_(1)  # CUPTI's first stall, outside
        sync()
        with record_function(STEP):
            forward(engine.runner, step)
            sync()
    events = intervals(prof)
    timeline = step_timeline(events)
    _, device = step_activities(events)
    finish(engine)
    gaps = idle_by_gap(device)
    return timeline | {
        "activities": len(device),
        "idle_by_gap_us": {k: round(v, 1) for k, v in gaps.most_common(6)},
    }


def idle_by_gap(device: list[tuple[float, float, str]]) -> Counter[str]:
    """The device's idle µs between activities (start, end, name; sorted by start), summed by
    "the activity that ended last -> the one that starts": activities overlap under PDL, so a
    gap opens only past the latest end so far."""
    gaps: Counter[str] = Counter()
    reach, last = None, ""
    for a, b, name in device:
        if reach is not None and a > reach:
            gaps[f"{last[:30]} -> {name[:30]}"] += a - reach
        if reach is None or b > reach:
            reach, last = b, name
    return gaps


def step_kernels(engine: LLMEngine, batch: int, steps: int = 8) -> dict:
    """Kernels of whole decode steps (engine.step(): the forward, the LM head, sampling and the
    copies around them), by name, per step: what `kernels` leaves out, the step's tail."""
    start_decoding(engine, batch, steps + 20)
    for _ in range(3):
        engine.step()
    sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    names, device_us = device_kernels(prof, copies=True)
    finish(engine)
    return {
        "kernels_per_step": sum(names.values()) / steps,
        "device_ms_per_step": sum(device_us.values()) / steps / 1e3,
        "by_name": {n: [c / steps, round(device_us[n] / steps, 1)] for n, c in names.most_common()},
    }


def prefill_kernels(
    model: str, mode: str, lengths: list[int], trace_dir: str | None = None
) -> list[dict]:
    """One prompt of each length run alone (one output token, no prefix cache): the step's
    wall time against its kernels' device time, which kernels that is, and their count (the
    gap between wall and device time is the host's or the launches'), and the step's
    timeline (step_timeline: where that gap lies). With trace_dir, each profiled step's
    Chrome trace is written there as prefill-MODE-LENGTH.json."""
    engine = LLMEngine(
        EngineConfig(model=model, cuda_graph_mode=mode, max_model_len=max(lengths) + 16,
                     async_scheduling=False, enable_prefix_caching=False)
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    results = []
    for length in lengths:
        wall_ms = wall_ms_plain(engine, length)  # also the warm-up of this size
        engine.add_request(prompts(engine, 1, length)[0], params)
        sync()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            # the profiler's first device activity stalls the host ~2.6 ms (CUPTI's buffers,
            # h100-2026-11-27-s33.md): one before the step keeps that out of its timeline
            torch.ones(1, device=engine.config.device).add_(1)
            sync()
            with record_function(STEP):
                engine.step()
                sync()
        if trace_dir:
            prof.export_chrome_trace(f"{trace_dir}/prefill-{mode}-{length}.json")
        while engine.has_unfinished_requests():
            engine.step()
        engine.add_request(prompts(engine, 1, length)[0], params)
        sync()
        profiler = cProfile.Profile()
        profiler.enable()
        engine.step()
        sync()
        profiler.disable()
        while engine.has_unfinished_requests():
            engine.step()
        names, device_us = device_kernels(prof, copies=False)
        results.append({
            "mode": mode, "tokens": length, "wall_ms": wall_ms,
            "device_ms": sum(device_us.values()) / 1e3, "kernels": sum(names.values()),
            "top": {n: [names[n], round(us, 1)] for n, us in device_us.most_common(10)},
            "host_top": top_functions(profiler, 1, 15),
            "timeline": step_timeline(intervals(prof)),
        })  # fmt: skip
    engine.shutdown()
    return results


STEP = "profiled step"  # the record_function range around the profiled engine.step()
GRAPH_LAUNCH = "cudaGraphLaunch"


def intervals(prof) -> list[tuple[str, str, float, float]]:
    """(kind, name, start µs, end µs) of the profiler's events: kind "device" for the GPU's
    kernels, copies and memsets, "host" for the CPU's (runtime calls and ranges)."""
    return [
        ("device" if e.device_type == torch.autograd.DeviceType.CUDA else "host", e.name,
         e.time_range.start, e.time_range.end)
        for e in prof.events()
    ]  # fmt: skip


def step_activities(
    events: list[tuple[str, str, float, float]],
) -> tuple[tuple[float, float], list[tuple[float, float, str]]]:
    """The profiled step's host range, and the device's activities from its start on (start,
    end, name), in start order; not the device's copy of the step's range (a CUDA trace
    shows record_function ranges on the device too)."""
    (step,) = [(a, b) for kind, name, a, b in events if kind == "host" and name == STEP]
    device = sorted((a, b, name) for kind, name, a, b in events
                    if kind == "device" and a >= step[0] and name != STEP)  # fmt: skip
    return step, device


def step_timeline(events: list[tuple[str, str, float, float]]) -> dict:
    """Where a profiled step's wall time goes, in ms: the host's work before the device's
    first activity, the device's span from first start to last end (busy: the union of its
    activities; idle: the rest of the span), the host's after it, and the graph launches'
    host time. Only the device part is None on a CPU. The device's copy of the step's range
    (a CUDA trace shows record_function ranges on the device too) is no activity."""
    step, activities = step_activities(events)
    device = [(a, b) for a, b, _ in activities]
    launches = [b - a for kind, name, a, b in events if kind == "host" and name == GRAPH_LAUNCH]
    result = {"wall_ms": (step[1] - step[0]) / 1e3, "graph_launches": len(launches),
              "graph_launch_ms": sum(launches) / 1e3}  # fmt: skip
    if not device:
        return result | dict.fromkeys(("host_before_ms", "device_span_ms", "device_busy_ms",
                                       "device_idle_ms", "host_after_ms"))  # fmt: skip
    busy, reach = 0.0, device[0][0]
    for a, b in device:  # the union of the intervals, in start order
        busy += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    span = reach - device[0][0]
    return result | {
        "host_before_ms": (device[0][0] - step[0]) / 1e3,
        "device_span_ms": span / 1e3,
        "device_busy_ms": busy / 1e3,
        "device_idle_ms": (span - busy) / 1e3,
        "host_after_ms": (step[1] - reach) / 1e3,
    }


def wall_ms_plain(engine: LLMEngine, length: int, reps: int = 3) -> float:
    """Median wall time of the step that prefills a fresh prompt of `length` tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(reps):
        engine.add_request(prompts(engine, 1, length)[0], params)
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(times)


def per_call_us(fn: Callable[[], object], calls: int = 200) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def host_us(fn: Callable[[], object], calls: int = 100) -> float:
    """µs of host time a call of fn takes while the device is busy: the calls queue behind a
    sleep kernel longer than they take, so none waits for the device (per_call_us gives the
    larger of host and device time)."""
    fn()
    sync()
    torch.cuda._sleep(200_000_000)  # ~0.1 s at the H100's and H200's ~2 GHz
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    sync()
    return elapsed / calls * 1e6


def pieces(engine: LLMEngine, batch: int) -> dict:
    """In PIECEWISE mode: one eager attention call (a break of the captured graph, run with the
    live batch as a replay runs it) and one captured segment, each timed over back-to-back
    calls (host and device overlap, as in a step) and for its host time alone, and the
    break's device time alone."""
    step = one_decode_step(engine, batch)
    runner = engine.runner
    graph = runner.graphs.graphs[CudaGraphMode.PIECEWISE][step.desc]
    segment, brk = graph._steps[2], graph._steps[1]
    ctx = runner._context(step.padded_tokens, step.padded_reqs, step.desc)
    with forward_context(ctx):
        result = {
            "attention_call_us": per_call_us(brk),
            "segment_replay_us": per_call_us(segment),
            "attention_host_us": host_us(brk),
            "segment_host_us": host_us(segment),
            "breaks": graph.num_breaks,
        }
        latency = []
        for _ in range(50):
            sync()
            t0 = time.perf_counter()
            brk()
            sync()
            latency.append((time.perf_counter() - t0) * 1e6)
        result["attention_call_then_sync_us"] = statistics.median(latency)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(20):
                brk()
        g.replay()
        sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            g.replay()
        end.record()
        sync()
        result["attention_device_us"] = start.elapsed_time(end) * 1e3 / 200
        del g
    finish(engine)
    return result


def mixed_step_ms(engine: LLMEngine, decodes: int = 31, chunk: int = 256, reps: int = 5) -> dict:
    """One step holding a fresh `chunk`-token prompt beside `decodes` running decodes."""
    start_decoding(engine, decodes, 1000)
    times, modes = [], Counter()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for _ in range(reps):
        engine.step()
        before = dict(engine.graph_report()["steps"])
        engine.add_request(prompts(engine, 1, chunk)[0], params)
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        after = engine.graph_report()["steps"]
        modes.update(m for m in after if after[m] > before.get(m, 0))
    finish(engine)
    return {"mixed_step_ms": statistics.median(times), "step_mode": ",".join(modes)}


def build(
    model: str, mode: str, quantization: str | None = None, loras: int = 0, rank: int = 16
) -> LLMEngine:
    """Without async scheduling: the sections below schedule and run steps one at a time. With
    loras, LoRA on with slots for that many adapters of that rank."""
    return LLMEngine(
        EngineConfig(
            model=model,
            cuda_graph_mode=mode,
            max_model_len=2048,
            async_scheduling=False,
            quantization=quantization,
            enable_lora=loras > 0,
            max_loras=max(loras, 1),
            max_lora_rank=rank,
        )
    )


SECTIONS = {"decode", "phases", "kernels", "pieces", "mixed", "host", "prefill", "step-kernels",
            "timeline"}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:qwen3-0.6b")
    parser.add_argument("--modes", default="none,piecewise,full_and_piecewise")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument(
        "--sections",
        default="decode,phases,kernels,pieces,mixed",
        help="also: host (cProfile of decode steps), prefill (one prompt's kernels), "
        "step-kernels (the kernels of whole decode steps: forward, LM head, sampling), "
        "timeline (one decode forward: device busy and idle, idle by the gap's ends)",
    )
    parser.add_argument("--label", default="", help="a tag for this tree, e.g. a commit")
    parser.add_argument(
        "--num-loras", type=int, default=0, help="random adapters the decode requests take"
    )
    parser.add_argument("--lora-rank", type=int, default=16, help="their rank (default 16)")
    parser.add_argument("--quantization", help="e.g. fp8: the decode sections on FP8 weights")
    parser.add_argument("--prefill-lengths", default="512,2048,8192", help="prefill section")
    parser.add_argument("--trace-dir", help="prefill section: write each step's Chrome trace here")
    parser.add_argument("--json", help="append every result here as a JSON line")
    parser.add_argument("--no-pdl", action="store_true", help="A/B: launch without PDL")
    parser.add_argument("--no-gemv", action="store_true", help="A/B: cuBLAS for every projection")
    parser.add_argument(
        "--gemv-rows",
        type=int,
        help="A/B: the small-batch projection kernel up to this many rows, for every weight "
        "size gemv.ROW_LIMITS admits (1: one row, as before the tl.dot rows)",
    )
    parser.add_argument(
        "--no-fuse", action="store_true", help="A/B: small-batch projections without the norms"
    )
    parser.add_argument(
        "--no-sdpa", action="store_true", help="A/B: fresh prompts through the paged kernel"
    )
    parser.add_argument(
        "--fp8-dot-rows", type=int, help="A/B: fp8.FP8_DOT_ROWS (0: the weight-only dot)"
    )
    args = parser.parse_args()
    if args.num_loras < 0 or args.lora_rank < 1:
        parser.error("--num-loras must be at least 0 and --lora-rank at least 1")
    if args.no_sdpa:
        importlib.import_module("ostinato.attention.triton_backend").SDPA_MIN_TOKENS = 1 << 62
    if args.no_pdl:
        importlib.import_module("ostinato.kernels.dispatch").PDL = False
    if args.fp8_dot_rows is not None:
        importlib.import_module("ostinato.kernels.fp8").FP8_DOT_ROWS = args.fp8_dot_rows
    if args.no_fuse:
        importlib.import_module("ostinato.layers.linear").FUSE = False
    gemv = importlib.import_module("ostinato.kernels.gemv")
    for table in ("ROW_LIMITS", "PLAIN_ROW_LIMITS"):
        if args.gemv_rows is not None:
            limits = tuple((elements, args.gemv_rows) for elements, _ in getattr(gemv, table))
            setattr(gemv, table, limits)
        if args.no_gemv:
            setattr(gemv, table, ())
    sections = set(args.sections.split(","))
    if sections - SECTIONS:
        parser.error(
            f"unknown --sections {','.join(sorted(sections - SECTIONS))}: "
            f"choose among {','.join(sorted(SECTIONS))}"
        )
    lengths = [int(n) for n in args.prefill_lengths.split(",")]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    bandwidth = copy_bandwidth() if "decode" in sections else None
    rows = []

    def emit(**result) -> None:
        loras = {"num_loras": args.num_loras} if args.num_loras else {}
        result = {"label": args.label, "model": args.model, **loras, **result}
        rows.append(result)
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")

    for mode in args.modes.split(","):
        if "prefill" in sections:
            for result in prefill_kernels(args.model, mode, lengths, args.trace_dir):
                emit(section="prefill", **result)
        engine = build(args.model, mode, args.quantization, args.num_loras, args.lora_rank)
        adapter_dir = tempfile.TemporaryDirectory(prefix="ostinato-lora-")
        _adapters[:] = random_adapters(engine, args.num_loras, args.lora_rank, adapter_dir.name)
        for batch in batches:
            if "decode" in sections:
                ms = decode_ms(engine, batch, args.steps)
                floor = decode_floor_bytes(engine, batch, PROMPT + args.steps // 2) / bandwidth
                emit(mode=mode, batch=batch, section="decode", tpot_ms=ms,
                     floor_ms=floor * 1e3, ratio=ms / (floor * 1e3))  # fmt: skip
            if "phases" in sections:
                emit(mode=mode, batch=batch, section="phases", **phases(engine, batch, 20))
            if "kernels" in sections and mode != "none":
                emit(mode=mode, batch=batch, section="kernels", **kernels(engine, batch))
            if "timeline" in sections:
                emit(mode=mode, batch=batch, section="timeline", **forward_timeline(engine, batch))
            if "step-kernels" in sections:
                emit(mode=mode, batch=batch, section="step-kernels", **step_kernels(engine, batch))
            if "host" in sections:
                emit(mode=mode, batch=batch, section="host", **host_profile(engine, batch, 20))
            if "pieces" in sections and mode == "piecewise":
                emit(mode=mode, batch=batch, section="pieces", **pieces(engine, batch))
        if "mixed" in sections:
            emit(mode=mode, section="mixed", **mixed_step_ms(engine))
        engine.shutdown()
        adapter_dir.cleanup()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    skip = {"label", "model", "section", "by_name", "top", "host_top"}
    for row in rows:
        fields = "  ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
            for k, v in row.items()
            if k not in skip
        )
        print(f"{row['label']:>8} {row['model'][-12:]:>12} {row['section']:>8}  {fields}")
    for row in rows:
        if row["section"] == "kernels":
            print(f"kernels of one {row['mode']} decode step ({row['label']}), count, device µs:")
            for name, (count, us) in list(row["by_name"].items())[:14]:
                print(f"  {count:5d} {us:9.1f}  {name}")
        if row["section"] == "step-kernels":
            print(f"kernels of a whole {row['mode']} decode step, batch {row['batch']}, per step,")
            print("count, device µs:")
            for name, (count, us) in list(row["by_name"].items())[:24]:
                print(f"  {count:5.1f} {us:9.1f}  {name}")
        if row["section"] == "prefill":
            print(f"kernels of a {row['tokens']}-token prefill ({row['mode']}), count, device µs:")
            for name, (count, us) in row["top"].items():
                print(f"  {count:5d} {us:9.1f}  {name}")
            print(f"host time of that prefill step ({row['mode']}), profiled:")
            print("\n".join(f"  {line}" for line in row["host_top"]))
        if row["section"] == "host":
            print(f"host time of one {row['mode']} step, batch {row['batch']} ({row['label']}):")
            print("\n".join(f"  {line}" for line in row["top"]))


if __name__ == "__main__":
    main()
