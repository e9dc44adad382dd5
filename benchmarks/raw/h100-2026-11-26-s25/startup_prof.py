"""Session 25: where eager-capture start-up goes (qwen3-0.6b): cProfile of the first LLM(...)
of a fresh process, run after a `bench startup` has filled Triton's disk cache."""
import cProfile, io, pstats, time
import torch
from ostinato import LLM

prof = cProfile.Profile()
t = time.perf_counter(); prof.enable(); llm = LLM("random:qwen3-0.6b"); prof.disable()
print(f"profiled start-up {time.perf_counter() - t:.2f} s")
for key in ("cumulative", "tottime"):
    out = io.StringIO(); pstats.Stats(prof, stream=out).sort_stats(key).print_stats(50)
    print("\n".join(l[:230] for l in out.getvalue().splitlines()[:75]))
