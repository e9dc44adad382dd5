"""Where a decode step's time goes: host phases timed with device syncs, and the graph alone.

PYTHONPATH=. python3 benchmarks/profile_step.py --model random:qwen3-0.6b --batch-size 1
"""

import argparse
import time

import torch

from ostinato.config import EngineConfig
from ostinato.context import ForwardContext, forward_context
from ostinato.engine.engine import LLMEngine
from ostinato.graphs.modes import CudaGraphMode
from ostinato.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:qwen3-0.6b")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, max_model_len=2048))
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for _ in range(args.batch_size):
        engine.add_request(list(range(100, 228)), params)
    for _ in range(5):
        engine.step()
    runner, sync = engine.runner, torch.cuda.synchronize
    names = ["schedule", "prepare", "replay+logits", "sample", "step (no syncs)"]
    phases = dict.fromkeys(names, 0.0)
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        batch = engine.scheduler.schedule()
        t1 = time.perf_counter()
        step = runner.build_step(batch)
        assert step.mode is CudaGraphMode.FULL, "a uniform decode batch should replay a FULL graph"
        runner.buffers.load(step)
        sync()
        t2 = time.perf_counter()
        ctx = ForwardContext(
            runner.buffers.metadata(step.padded_tokens, step.padded_reqs),
            runner.kv_caches,
            runner.backend,
        )
        with forward_context(ctx):
            hidden = runner.graphs.run(step.mode, step.desc, step.num_tokens, None)
        logits = runner._logits(hidden, len(step.sampling))
        sync()
        t3 = time.perf_counter()
        out = runner.sampler(logits, step.sampling)
        t4 = time.perf_counter()
        engine.scheduler.complete(batch)
        seqs = {seq.request_id: seq for seq in batch.seqs}
        for row, tok in zip(step.sampling, out.token_ids, strict=True):
            engine._append_token(seqs[row.request_id], tok, None)
        for name, dt in zip(list(phases)[:4], (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            phases[name] += dt
        sync()
        t6 = time.perf_counter()
        engine.step()
        sync()
        phases["step (no syncs)"] += time.perf_counter() - t6
    g = runner.graphs.graphs[CudaGraphMode.FULL][step.desc]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        g.replay()
    end.record()
    sync()
    for name, total in phases.items():
        print(f"{name:>16}: {total / args.steps * 1e3:.3f} ms")
    graph_ms = start.elapsed_time(end) / 100
    print(f"{'graph on device':>16}: {graph_ms:.3f} ms (100 back-to-back replays)")


if __name__ == "__main__":
    main()
