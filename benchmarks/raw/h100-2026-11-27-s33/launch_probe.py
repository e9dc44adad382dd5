"""Session 33 probe: why a FULL prefill graph's replay costs the host ~0.5 ms (cudaGraphLaunch)
while a graph of 1024 one-program Triton kernels costs 5 us. Times CUDAGraph.replay() on the
host for (1) the engine's own graphs, (2) synthetic graphs of cuBLAS matmuls and of Triton
kernels, alone and alternating."""

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
OUT = os.environ.get("OUT", ".")


def host_us(fn, reps=20, sync_before=True):
    ts = []
    for i in range(reps + 3):
        if sync_before:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if i >= 3:
            ts.append((t1 - t0) * 1e6)
    torch.cuda.synchronize()
    return round(statistics.median(ts), 1)


def emit(**r):
    print(json.dumps(r), flush=True)
    with open(os.path.join(OUT, "launch_probe.jsonl"), "a") as f:
        f.write(json.dumps(r) + "\n")


def capture(body, n, pool=None):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream, pool=pool):
        for _ in range(n):
            body()
    torch.cuda.synchronize()
    return g


def synthetic():
    from graph_launch import _bump_kernel  # noqa: F401

    import graph_launch

    x = torch.zeros(1, dtype=torch.int32, device="cuda")
    bump_pdl = graph_launch.graph_of(112, True, x)
    bump = graph_launch.graph_of(112, False, x)
    emit(kind="bump112_pdl", host_us=host_us(bump_pdl.replay))
    emit(kind="bump112", host_us=host_us(bump.replay))
    for m, k, n in ((512, 1024, 4096), (2048, 1024, 4096), (1, 1024, 4096), (64, 1024, 4096)):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

        def mm(a=a, b=b, out=out):
            torch.mm(a, b.t(), out=out)

        for count in (28, 112):
            g = capture(mm, count)
            prof_name = None
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
                g.replay()
                torch.cuda.synchronize()
            names = {e.name for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA}
            prof_name = sorted(names)[:2]
            emit(kind="mm", m=m, k=k, n=n, count=count, host_us=host_us(g.replay), kernels=prof_name)
        # mixed: mm + bump alternately in one graph
        bl = graph_launch.Launch(graph_launch._bump_kernel, (1, 1, 1), num_head=1, tail=(),
                                 constexprs={"PDL": True}, launch_pdl=True)

        def mixed(mm=mm):
            mm()
            bl(x)

        g = capture(mixed, 56)
        emit(kind="mm+bump_pdl", m=m, count=56, host_us=host_us(g.replay))
        g2 = capture(mm, 112)
        # alternate two graphs
        def alt(g=g, g2=g2):
            g.replay()
            g2.replay()

        emit(kind="alternate mm graphs (both)", m=m, host_us=host_us(alt))
        # back to back without sync: second launch while first runs
        emit(kind="mm112 no sync between", m=m, host_us=host_us(g2.replay, sync_before=False))


def engine_graphs():
    from ostinato.config import EngineConfig
    from ostinato.engine.engine import LLMEngine
    from ostinato.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model="random:qwen3-0.6b", cuda_graph_mode="full_and_piecewise",
                                    max_model_len=2304, enable_prefix_caching=False,
                                    async_scheduling=False))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for n in (2048, 512):  # valid metadata in the buffers for every size below
        engine.add_request(list(range(100, 100 + n)), params)
        while engine.has_unfinished_requests():
            engine.step()
    gr = engine.runner.graphs
    picked = {}
    for mode, graphs in gr.graphs.items():
        for desc, g in graphs.items():
            if desc.num_tokens in (1, 32, 256, 512, 1024, 2048) and desc.num_active_loras == 0:
                picked[(mode.name, desc)] = g
    for (mode, desc), g in sorted(picked.items(), key=lambda kv: (kv[0][0], kv[0][1].num_tokens)):
        segs = [s for s in g._steps if getattr(s, "__self__", None) is not None
                and isinstance(s.__self__, torch.cuda.CUDAGraph)]
        first = segs[0]
        r = dict(kind="engine", mode=mode, tokens=desc.num_tokens, reqs=desc.num_reqs,
                 q=desc.uniform_query_len, steps=len(g._steps), segments=len(segs))
        if mode == "FULL":
            r["replay_host_us"] = host_us(g.replay)
        r["first_segment_host_us"] = host_us(first)
        emit(**r)
    engine.shutdown()


if __name__ == "__main__":
    torch.manual_seed(0)
    which = sys.argv[1:] or ["synthetic", "engine"]
    if "synthetic" in which:
        synthetic()
    if "engine" in which:
        engine_graphs()
