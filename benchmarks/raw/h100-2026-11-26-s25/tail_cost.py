"""Session 25: what the step-tail warm-up costs, and whether fewer row counts would do. The
engine starts without it (patched out); then the LM head runs once per row count (LADDER=1:
first a ladder of counts, then every count), each call timed to the device's end; then the
sampler at 3 and 256 rows, twice. A count whose first call takes > 0.3 ms was cold."""
import os, time
import torch
from ostinato.runner import model_runner
from ostinato.runner.sampler import warm_up_rows

model_runner.ModelRunner._warm_up_tail = lambda self: None
from ostinato import LLM

llm = LLM("random:qwen3-0.6b", max_model_len=2048)
runner = llm.engine.runner
model, sampler = runner.model, runner.sampler
hidden = torch.zeros(256, model.lm_head.weight.shape[1], dtype=torch.bfloat16, device="cuda")

def timed(fn):
    torch.cuda.synchronize(); t = time.perf_counter(); out = fn(); torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3, out

def sweep(counts, name):
    times = {m: timed(lambda: model.compute_logits(hidden[:m]))[0] for m in counts}
    slow = {m: round(t, 2) for m, t in times.items() if t > 0.3}
    print(f"{name}: {len(counts)} counts, {sum(times.values()):.1f} ms in all, {len(slow)} slow: {slow}")

if os.environ.get("LADDER") == "1":
    sweep(sorted({1, 2, 3, 4, 6, 8, 12, *range(16, 257, 16)}), "ladder")
sweep(range(1, 257), "every count, first")
sweep(range(1, 257), "every count, again")
logits = model.compute_logits(hidden)
for rnd in ("first", "again"):
    for rows in (3, 256):
        ms, _ = timed(lambda: sampler(logits[:rows], warm_up_rows(rows)))
        print(f"sampler {rows} rows, {rnd}: {ms:.1f} ms")
