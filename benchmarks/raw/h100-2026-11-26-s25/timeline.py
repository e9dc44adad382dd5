"""Session 25: where a burst's first tokens wait. 80 prompts of 256-768 random tokens at once,
offline (LLMEngine), with per-step host timestamps: schedule, build_step, submit (launch) and
result, per batch, ms from the burst's start; each batch's device time by CUDA events. With
SYNC=1, torch's sync debug mode names any synchronising call while the host launches a batch
behind a running one. Run with async scheduling on and off (ASYNC=0)."""
import os, random, sys, time, warnings
import torch
from ostinato import LLM, SamplingParams

asyn = os.environ.get("ASYNC", "1") == "1"
llm = LLM("random:qwen3-0.6b", max_model_len=2048, async_scheduling=asyn,
          enable_prefix_caching=False)
eng = llm.engine
T0 = [0.0]
now = lambda: round((time.perf_counter() - T0[0]) * 1e3, 1)
log = []
sched, build, submit = eng.scheduler.schedule, eng.runner.build_step, eng.executor.submit

def schedule():
    t = now(); b = sched()
    if b is not None:
        log.append(("sched", t, now(), b.num_tokens, len(b.seqs)))
    return b

def build_step(*a, **k):
    t = now(); s = build(*a, **k); log.append(("build", t, now())); return s

def submit_(step):
    t = now()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    if os.environ.get("SYNC") == "1" and len(eng.in_flight):
        torch.cuda.set_sync_debug_mode("warn")
    try:
        p = submit(step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    end.record()
    log.append(("launch", t, now()))
    res = p.result
    def result():
        t1 = now(); r = res(); log.append(("result", t1, now(), round(start.elapsed_time(end), 1))); return r
    p.result = result
    return p

eng.scheduler.schedule, eng.runner.build_step, eng.executor.submit = schedule, build_step, submit_
rng = random.Random(0)
params = SamplingParams(max_tokens=16, ignore_eos=True)
def burst(n=80):
    prompts = [[rng.randrange(256) for _ in range(rng.randint(256, 768))] for _ in range(n)]
    log.clear(); T0[0] = time.perf_counter(); first = {}
    for i, p in enumerate(prompts):
        eng.add_request(p, params, f"r{rng.random()}")
    steps = []
    while eng.has_unfinished_requests():
        t = now(); outs = eng.step(); steps.append((t, now(), len(outs)))
        for o in outs:
            if o.request_id not in first and o.token_ids:
                first[o.request_id] = now()
    f = sorted(first.values())
    return f, steps

for rnd in range(3):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f, steps = burst()
    print(f"async={asyn} round {rnd}: first tokens at {f[0]}..{f[-1]} ms, p50 {f[len(f)//2]}, mean {sum(f)/len(f):.1f}")
    print("  steps (call, return, outputs):", steps[:8])
    for e in log[:24]:
        print("   ", e)
    for w in caught[:10]:
        print("   sync warning:", str(w.message)[:200], w.filename, w.lineno)
    sys.stdout.flush()
