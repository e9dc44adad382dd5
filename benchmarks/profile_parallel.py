"""Where a multi-GPU decode step's time goes.

PYTHONPATH=. python3 benchmarks/profile_parallel.py --model random:llama-3.1-8b \
    --tensor-parallel-size 2 --batch-size 1,32

1. The engine's step (ms per decode step, median over --steps) and, on rank 0, how its host
   time splits: building the step, submitting it (control messages + rank 0's own stage), and
   waiting for the sampled tokens.
2. For tensor parallelism, the all-reduces alone: two processes replay a CUDA graph holding
   exactly the all-reduces of one decode step (two per layer plus the embedding's, on
   [batch, hidden] in the model dtype) and the vocab all-gather of the logits; their time over
   the step time is the all-reduce share.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ostinato.config import EngineConfig
from ostinato.engine.engine import LLMEngine
from ostinato.sampling_params import SamplingParams


def timed(fn, into: list[float]):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    return wrapper


def profile_engine(args, batch: int) -> dict:
    config = EngineConfig(
        model=args.model,
        max_model_len=2048,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        cuda_graph_mode=args.cuda_graph_mode,
    )
    engine = LLMEngine(config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
        for i in range(batch):
            engine.add_request([100 + i] * 128, params)
        for _ in range(20):  # prefill and warm-up
            engine.step()
        build, submit, wait, steps = [], [], [], []
        engine.runner.build_step = timed(engine.runner.build_step, build)
        submit_step = timed(engine.executor.submit, submit)

        def submit_and_time_its_wait(step):
            pending = submit_step(step)
            pending.result = timed(pending.result, wait)
            return pending

        engine.executor.submit = submit_and_time_its_wait
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        report = engine.graph_report()
    finally:
        engine.shutdown()
    ms = lambda xs: statistics.median(xs) * 1e3 if xs else 0.0
    return {
        "model": args.model,
        "tp": args.tensor_parallel_size,
        "pp": args.pipeline_parallel_size,
        "mode": report["cuda_graph_mode"],
        "batch_size": batch,
        "step_ms": ms(steps),
        "host_build_ms": ms(build),
        "host_submit_ms": ms(submit),
        "host_wait_ms": ms(wait),
        "steps": report["steps"],
    }


def _allreduce_worker(rank: int, world: int, port: int, shapes: dict, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device(rank))
    dtype = torch.bfloat16
    x = torch.randn(shapes["batch"], shapes["hidden"], device="cuda", dtype=dtype)
    logits = torch.randn(shapes["batch"], shapes["vocab"] // world, device="cuda", dtype=dtype)
    gathered = [torch.empty_like(logits) for _ in range(world)]
    for _ in range(3):  # warm the communicator before capture
        dist.all_reduce(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(shapes["allreduces"]):
            dist.all_reduce(x)
        dist.all_gather(gathered, logits)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    if rank == 0:
        out.put(start.elapsed_time(end) / 50)
    dist.destroy_process_group()


def allreduce_ms(model: str, batch: int, world: int) -> float:
    from ostinato.loader import load_hf_config

    c = load_hf_config(model)
    shapes = {
        "batch": batch,
        "hidden": c.hidden_size,
        "vocab": c.vocab_size,
        "allreduces": 2 * c.num_hidden_layers + 1,  # o_proj and down_proj per layer, embedding
    }
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=_allreduce_worker, args=(r, world, port, shapes, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    result = out.get(timeout=300)
    for p in procs:
        p.join(60)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--batch-size", default="1,32")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--cuda-graph-mode", default="full_and_piecewise")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    for batch in (int(b) for b in args.batch_size.split(",")):
        result = profile_engine(args, batch)
        if args.tensor_parallel_size > 1:
            ms = allreduce_ms(args.model, batch, args.tensor_parallel_size)
            result.update(allreduce_ms=ms, allreduce_share=ms / result["step_ms"])
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
