"""Session 26: where eager-capture start-up goes (qwen3-0.6b), by wall-clock timers around the
runtime's own functions (no profiler): per graph mode, the capture (forward under capture plus
segment begin/end), segment instantiation alone, the dummy-batch fill, warm-ups; the KV sizing
step; the eager warm-up's attention batches and tail; Triton's first-use loads."""
import collections, json, sys, time
import torch
import triton.runtime.jit as jit
from ostinato.graphs import capture as cap
from ostinato.runner import model_runner as mr, sampler as smp

acc, cnt = collections.defaultdict(float), collections.Counter()

def timed(owner, name, key=None):
    fn = getattr(owner, name)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            label = key(a) if key else name
            acc[label] += time.perf_counter() - t
            cnt[label] += 1
    setattr(owner, name, wrapper)

timed(cap.GraphRunner, "_capture_warm", lambda a: f"capture {a[1].value}" + (" prefill" if a[2].num_reqs and a[2].num_tokens > a[2].num_reqs else ""))
warmed = []
_warm_up = cap.GraphRunner._warm_up
cap.GraphRunner._warm_up = lambda self, desc, fn: warmed.append(str(desc)) or _warm_up(self, desc, fn)
timed(cap.GraphRunner, "_warm_up")
timed(torch.cuda.CUDAGraph, "capture_end")
timed(torch.cuda.CUDAGraph, "capture_begin")
timed(mr.ModelRunner, "_fill_dummy_desc")
timed(mr.ModelRunner, "_run_dummy")
timed(mr.ModelRunner, "_warm_up_tail")
timed(smp.Sampler, "__call__", lambda a: "sampler call")
timed(jit.JITFunction, "_do_compile", lambda a: "triton first use (_do_compile)")
from ostinato import LLM
t = time.perf_counter()
llm = LLM("random:qwen3-0.6b")
total = time.perf_counter() - t
r = llm.graph_report()
print(f"startup {total:.3f} s; phases {json.dumps({k: round(v, 3) for k, v in r['start_up_seconds'].items()})}; capture {r['capture_seconds']:.3f}; warm-up {r['eager_warm_up_seconds']:.3f}")
for k in sorted(acc, key=acc.get, reverse=True):
    print(f"{acc[k]:8.3f} s {cnt[k]:6d} x  {acc[k] / cnt[k] * 1e3:8.3f} ms  {k}")
print("warm-ups before captures:", warmed)
