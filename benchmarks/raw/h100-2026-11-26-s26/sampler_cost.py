"""Session 26: the sampler's steady-state time per call (ms, CUDA events over 20 calls after 3
warm-ups) on qwen3-0.6b-shaped logits (151,936 wide), by kind of request and row count."""
import sys
import torch
from ostinato.runner.sampler import Sampler
from ostinato.runner.step import SamplingRow
from ostinato.sampling_params import SamplingParams

sampler = Sampler()
kinds = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top_k=50": dict(temperature=0.8, top_k=50),
    "top_k=50,top_p=0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
    "top_k=1000,top_p=0.95": dict(temperature=0.8, top_k=1000, top_p=0.95),
    "top_p=0.9": dict(temperature=0.8, top_p=0.9),
}
gen = torch.Generator(device="cuda").manual_seed(0)
for n in (1, 32, 256):
    logits = torch.randn(n, 151936, device="cuda", generator=gen) * 3
    for name, params in kinds.items():
        rows = [SamplingRow("r", SamplingParams(**params), 0)] * n
        for _ in range(3):
            sampler.launch(logits, rows)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); start.record()
        for _ in range(20):
            sampler.launch(logits, rows)
        end.record(); torch.cuda.synchronize()
        print(f"{sys.argv[1]} rows {n:3d} {name:22s} {start.elapsed_time(end) / 20:7.3f} ms")
