"""Serving stall diagnosis (session 24): the engine offline, 80 prompts of 256-768 random tokens,
rounds: fresh, the same prompts again (prefix-cache hits) twice, then one at a time. Every step
slower than 30 ms is printed with its batch, and every Triton compile with its time."""
import random, sys, time
import triton
from ostinato import LLM, SamplingParams

events = []
def hook(*args, **kw):
    fn = kw.get("fn")
    events.append((time.perf_counter(), getattr(fn, "name", str(fn))))
    return False
triton.knobs.runtime.jit_post_compile_hook = hook

prefix = "--no-prefix-caching" not in sys.argv
import os
llm = LLM(os.environ.get("STALL_MODEL", "random:qwen3-0.6b"), max_model_len=2048, enable_prefix_caching=prefix)
eng = llm.engine
batches = []
schedule = eng.scheduler.schedule
def logged():
    b = schedule()
    if b is not None:
        batches.append((b.num_tokens, len(b.seqs), max(b.query_lens)))
    return b
eng.scheduler.schedule = logged
rng = random.Random(0)
prompts = [[rng.randrange(256) for _ in range(rng.randint(256, 768))] for _ in range(int(os.environ.get("STALL_N", 80)))]
params = SamplingParams(max_tokens=int(os.environ.get("STALL_TOKENS", 128)), ignore_eos=True)
n = 0

def run(name, arrivals):
    global n
    events.clear()
    t0 = time.perf_counter(); first = {}; slow = []; steps = 0
    pending = list(arrivals)
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][0] <= time.perf_counter() - t0:
            _, p = pending.pop(0); n += 1; eng.add_request(p, params, f"r{n}")
        if not eng.has_unfinished_requests():
            time.sleep(0.0005); continue
        del batches[:]
        s = time.perf_counter(); outs = eng.step(); d = time.perf_counter() - s; steps += 1
        for o in outs:
            if o.request_id not in first and o.token_ids:
                first[o.request_id] = time.perf_counter()
        if d > 0.03:
            slow.append((round(s - t0, 3), round(d * 1e3, 1), list(batches)))
    ttft = sorted(first.values())
    print(f"{name}: {steps} steps, {time.perf_counter() - t0:.2f} s, first tokens from "
          f"{(ttft[0]-t0)*1e3:.0f} to {(ttft[-1]-t0)*1e3:.0f} ms; stats {eng.stats()['prefix_cache_hits']} hit tokens")
    for row in slow[:12]:
        print("   slow step at", row[0], "s:", row[1], "ms, batches (tokens, reqs, max q)", row[2][:3])
    for t, name_ in events[:20]:
        print(f"   compiled {name_} at {t - t0:.3f} s")
    sys.stdout.flush()

run("fresh, all at once", [(0, p) for p in prompts])
run("same prompts, all at once", [(0, p) for p in prompts])
run("same prompts again, all at once", [(0, p) for p in prompts])
run("same prompts, 8 a second", [(i / 8, p) for i, p in enumerate(prompts[:len(prompts) * 3 // 10])])
fresh = [[rng.randrange(256) for _ in range(rng.randint(256, 768))] for _ in range(len(prompts) * 3 // 10)]
run("new prompts, 8 a second", [(i / 8, p) for i, p in enumerate(fresh)])
