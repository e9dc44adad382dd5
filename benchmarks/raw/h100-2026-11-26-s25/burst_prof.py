"""Session 25: why the first burst after start-up is slow (timeline.py: round 0's 8,192-token
launches take ~20-30 ms of host time, round 1's ~2 ms). Per round: first-token times, the
caching allocator's counters (device mallocs/frees, retries), and with PROF=1 the host ops
and CUDA runtime calls by self CPU time (torch.profiler)."""
import os, random, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from ostinato import LLM, SamplingParams

llm = LLM("random:qwen3-0.6b", max_model_len=2048, enable_prefix_caching=False)
eng = llm.engine
rng = random.Random(0)
params = SamplingParams(max_tokens=16, ignore_eos=True)
KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "segment.all.current",
        "reserved_bytes.all.current", "num_sync_all_streams")

def burst(n=80):
    prompts = [[rng.randrange(256) for _ in range(rng.randint(256, 768))] for _ in range(n)]
    t0 = time.perf_counter(); first = {}
    for p in prompts:
        eng.add_request(p, params, f"r{rng.random()}")
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id not in first and o.token_ids:
                first[o.request_id] = (time.perf_counter() - t0) * 1e3
    f = sorted(first.values())
    return f"first tokens {f[0]:.1f}..{f[-1]:.1f} ms, mean {sum(f)/len(f):.1f}"

prof_on = os.environ.get("PROF") == "1"
for rnd in range(3):
    before = torch.cuda.memory_stats()
    if prof_on and rnd < 2:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            line = burst()
    else:
        prof, line = None, burst()
    after = torch.cuda.memory_stats()
    diffs = {k: after.get(k, 0) - before.get(k, 0) for k in KEYS}
    print(f"round {rnd} (profiled={prof is not None}): {line}; allocator {diffs}")
    if prof is not None:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    sys.stdout.flush()
