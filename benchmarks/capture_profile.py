"""Where start-up capture time and graph memory go, and what lazy capture costs on first use.

    python3 benchmarks/capture_profile.py --model random:qwen3-0.6b --max-model-len 2048

Prints one JSON object per line (and appends them to --out):
- "stream_workspace": device memory the first cuBLAS call on a new stream takes (every
  capture runs on a side stream, so its graphs own such a workspace);
- "eager": per mode, the capture phase split into capture attempts (of which segment ends, i.e.
  graph instantiation) and warm-ups, and graph memory split into the allocator's share (the
  graph pool) and the rest (driver-side graph state, module loads);
- "lazy": start-up, the first request's TTFT, then every key captured smallest first: the
  cost of a cold first use (capture stopped at a cold kernel + eager step + capture) against a
  warm one (capture + replay) and against a plain replay, and the graph memory at the end
  against the budget the KV sizing left for graphs.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections import defaultdict

import torch

from ostinato import LLM, SamplingParams
from ostinato.graphs import breakable
from ostinato.graphs.capture import GraphRunner
from ostinato.graphs.modes import CudaGraphMode
from ostinato.kernels import variants

timings: dict[str, list[float]] = defaultdict(list)


def timed(cls, name: str, key: str, sync: bool = False) -> None:
    """Wrap cls.name to append its seconds to timings[key] (after a device sync if asked)."""
    inner = getattr(cls, name)

    def wrapper(*args, **kwargs):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            if sync:
                torch.cuda.synchronize()
            timings[key].append(time.perf_counter() - start)

    setattr(cls, name, wrapper)


def emit(record: dict, out: str | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def stream_workspace() -> int:
    a = torch.randn(256, 256, device="cuda")
    a @ a  # the default stream's workspace exists from here on
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.cuda.stream(torch.cuda.Stream()):
        a @ a
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before


def eager_capture(args, mode: str) -> dict:
    timings.clear()
    variants._launched.clear()  # warm-ups as at start-up (Triton's own cache stays warm)
    memory = {}
    inner = GraphRunner.capture

    def capture(self, *a, **kw):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved, free = torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]
        inner(self, *a, **kw)
        memory["pool"] = torch.cuda.memory_reserved() - reserved
        memory["all"] = free - torch.cuda.mem_get_info()[0]

    GraphRunner.capture = capture
    start = time.perf_counter()
    llm = LLM(args.model, max_model_len=args.max_model_len, cuda_graph_mode=mode)
    startup = time.perf_counter() - start
    GraphRunner.capture = inner
    report = llm.graph_report()
    attempts = sum(timings["attempt"])
    result = {
        "profile": "eager",
        "mode": mode,
        "startup_s": startup,
        "capture_s": report["capture_seconds"],
        "graphs": sum(len(v) for v in report["captured"].values()),
        "warmups": report["warmups"],
        "capture_attempts": len(timings["attempt"]),
        "attempts_s": attempts,
        "segment_ends_s": sum(timings["segment_end"]),
        "segments": len(timings["segment_end"]),
        "warmups_and_rest_s": report["capture_seconds"] - attempts,
        "graph_memory_mib": report["graph_memory_bytes"] / 2**20,
        "pool_mib": memory["pool"] / 2**20,
        "outside_pool_mib": (memory["all"] - memory["pool"]) / 2**20,
        "budget_mib": llm.engine.runner.graph_memory_budget / 2**20,
    }
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def lazy_capture(args) -> dict:
    timings.clear()
    first_uses: list[dict] = []
    inner = GraphRunner._first_use

    def first_use(self, mode, desc, eager):
        torch.cuda.synchronize()
        warmups, attempts, start = self.num_warmups, len(timings["attempt"]), time.perf_counter()
        out = inner(self, mode, desc, eager)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        capture_s = sum(timings["attempt"][attempts:])
        first_uses.append(
            {
                "mode": mode.value,
                "num_tokens": desc.num_tokens,
                "cold": self.num_warmups > warmups,
                "seconds": seconds,
                "capture_s": capture_s,
                "eager_s": seconds - capture_s if self.num_warmups > warmups else 0.0,
            }
        )
        return out

    GraphRunner._first_use = first_use
    start = time.perf_counter()
    llm = LLM(args.model, max_model_len=args.max_model_len, cuda_graph_capture="lazy")
    startup = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 30000, (args.input_len,), generator=g).tolist()
    start = time.perf_counter()
    llm.engine.add_request(prompt, params)
    ttft = None
    while llm.engine.has_unfinished_requests():
        if llm.engine.step() and ttft is None:
            ttft = time.perf_counter() - start
    first_request = time.perf_counter() - start
    sizes = llm.engine.runner.graphs.dispatcher.capture_sizes()
    two = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for n in sizes["piecewise"]:  # smallest first, as serving meets them
        if 1 < n < args.max_model_len:  # a prompt of max_model_len tokens leaves none to sample
            llm.generate([torch.randint(0, 30000, (n,), generator=g).tolist()], two, False)
    for n in sizes["full"]:
        llm.generate([[100 + i] for i in range(n)], two, use_tqdm=False)
    report = llm.graph_report()
    replay = _replay_seconds(llm)
    GraphRunner._first_use = inner
    cold = [u for u in first_uses if u["cold"]]
    warm = [u for u in first_uses if not u["cold"]]
    mean = lambda rows, key: sum(r[key] for r in rows) / max(len(rows), 1)
    result = {
        "profile": "lazy",
        "startup_s": startup,
        "ttft_after_start_s": ttft,
        "first_request_s": first_request,
        "input_len": args.input_len,
        "graphs": sum(len(v) for v in report["captured"].values()),
        "warmups": report["warmups"],
        "capture_s": report["capture_seconds"],
        "cold_first_uses": len(cold),
        "cold_first_use_ms": 1e3 * mean(cold, "seconds"),
        "cold_eager_step_ms": 1e3 * mean(cold, "eager_s"),
        "warm_first_uses": len(warm),
        "warm_first_use_ms": 1e3 * mean(warm, "seconds"),
        "warm_capture_ms": 1e3 * mean(warm, "capture_s"),
        "replay_ms": replay,
        "graph_memory_mib": report["graph_memory_bytes"] / 2**20,
        "budget_mib": llm.engine.runner.graph_memory_budget / 2**20,
        "first_uses": first_uses,
    }
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def _replay_seconds(llm: LLM) -> float:
    """ms of one replay of the FULL graph of one request (synchronised); it reads whatever
    batch the buffers hold, which is fine for timing."""
    graphs = llm.engine.runner.graphs.graphs[CudaGraphMode.FULL]
    graph = min(graphs.items(), key=lambda kv: kv[0].num_tokens)[1]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 10 * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="random:qwen3-0.6b")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--modes", default="full_and_piecewise,full_decode_only,piecewise")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    timed(GraphRunner, "_capture_warm", "attempt")
    timed(breakable.BreakableGraph, "_end_segment", "segment_end")
    emit({"profile": "stream_workspace", "mib": stream_workspace() / 2**20}, args.out)
    emit(lazy_capture(args), args.out)  # first: nothing warm in this process yet
    for mode in args.modes.split(","):
        emit(eager_capture(args, mode), args.out)


if __name__ == "__main__":
    main()
