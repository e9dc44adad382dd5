"""Host time of one CUDA graph replay by its kernel count, with programmatic dependent launch
(PDL) and without: what `CUDAGraph.replay()` costs the host before it returns, and what the
replay costs the device, for graphs of N one-program Triton kernels (each waiting for the one
before it, as ostinato's kernels do).

    PYTHONPATH=. python3 benchmarks/graph_launch.py [--kernels 64,256,1024] [--json FILE]

A prefill step replays one FULL graph of about 260 kernels (qwen3-0.6b, 28 layers) and the
host waits for it: a replay whose launch takes the host hundreds of µs is on the time to
first token, unlike a decode step's, which async scheduling overlaps with the step before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton
import triton.language as tl

from ostinato.kernels.launch import Launch


@triton.jit
def _bump_kernel(x_ptr, PDL: tl.constexpr):
    """x[0] += 1 once its predecessor is done: one program, a few instructions."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(x_ptr, tl.load(x_ptr) + 1)


def graph_of(kernels: int, pdl: bool, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    bump = Launch(_bump_kernel, (1, 1, 1), num_head=1, tail=(), constexprs={"PDL": pdl},
                  launch_pdl=pdl)  # fmt: skip
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        bump(x)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(kernels):
            bump(x)
    return graph


def measure(kernels: int, pdl: bool, replays: int) -> dict:
    x = torch.zeros(1, dtype=torch.int32, device="cuda")
    graph = graph_of(kernels, pdl, x)
    host_us, device_us = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(replays + 3):  # the first replays upload the graph
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            host_us.append((t1 - t0) * 1e6)
            device_us.append(start.elapsed_time(end) * 1e3)
    ran = int(x.item()) - 1  # graph_of's first launch, outside the graph
    assert ran == kernels * (replays + 3), f"{ran} kernels ran, not all of every replay's"
    return {
        "kernels": kernels,
        "pdl": pdl,
        "replay_host_us": statistics.median(host_us),
        "replay_device_us": statistics.median(device_us),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default="64,256,1024", help="graph sizes, comma-separated")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--json", help="append one JSON line per graph to this file")
    args = parser.parse_args()
    sizes = args.kernels.split(",")
    if not all(n.isdigit() and int(n) > 0 for n in sizes) or args.replays < 1:
        parser.error("--kernels takes positive counts, e.g. 64,256; --replays at least 1")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device: it times CUDA graph replays")
    print("| kernels | PDL | replay(): host µs | replay: device µs | host µs a kernel |")
    print("|---|---|---|---|---|")
    for kernels in map(int, sizes):
        for pdl in (False, True):
            r = measure(kernels, pdl, args.replays)
            host, device = r["replay_host_us"], r["replay_device_us"]
            on = "on" if pdl else "off"
            print(f"| {kernels} | {on} | {host:.1f} | {device:.1f} | {host / kernels:.2f} |")
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
