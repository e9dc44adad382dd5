"""Session 26: what the step's tail costs at its first use (qwen3-0.6b, lazy capture so start-up
warmed nothing): the LM head's first and second call per row count, then the sampler's first
call per added path (each row set adds one kind of request to the ones before)."""
import time
import torch
from ostinato import LLM, SamplingParams
from ostinato.runner.step import SamplingRow, TokenHistory

llm = LLM("random:qwen3-0.6b", cuda_graph_capture="lazy")
runner = llm.engine.runner
hidden = torch.randn(256, 1024, dtype=torch.bfloat16, device="cuda")

def t(fn):
    torch.cuda.synchronize(); s = time.perf_counter(); fn(); torch.cuda.synchronize()
    return (time.perf_counter() - s) * 1e3

for n in (1, 2, 3, 5, 8, 9, 12, 16, 17, 24, 25, 32, 33, 40, 48, 56, 64, 72, 96, 128, 129, 136, 192, 200, 256):
    first = t(lambda: runner.model.compute_logits(hidden[:n]))
    again = t(lambda: runner.model.compute_logits(hidden[:n]))
    print(f"lm_head rows {n:4d}: first {first:7.2f} ms, again {again:6.3f} ms")
logits = runner.model.compute_logits(hidden)
h = TokenHistory(prompt=(1, 2), output=(3,), pending=False)
paths = [
    ("greedy", dict(temperature=0.0), {}),
    ("temperature", dict(temperature=0.7), {}),
    ("top_k", dict(temperature=0.7, top_k=8), {}),
    ("top_p", dict(temperature=0.7, top_p=0.9), {}),
    ("min_p", dict(temperature=0.7, min_p=0.05), {}),
    ("logprobs", dict(temperature=0.7, logprobs=2), {}),
    ("logit_bias", dict(temperature=0.7, logit_bias={5: 1.0}), {}),
    ("penalties", dict(temperature=0.7, presence_penalty=0.5, repetition_penalty=1.1), dict(history=h)),
    ("min_tokens", dict(temperature=0.7, min_tokens=1, max_tokens=2), dict(banned=(0,), min_tokens_left=1)),
    ("seeded", dict(temperature=0.7, seed=0), {}),
]
for rows in (3, 256):
    for name, params, extra in paths:
        r = [SamplingRow("r", SamplingParams(**params), 0, **extra)] * rows
        first = t(lambda: runner.sampler(logits[:rows], r))
        again = t(lambda: runner.sampler(logits[:rows], r))
        print(f"sampler {rows:3d} rows {name:12s}: first {first:7.2f} ms, again {again:6.3f} ms")
