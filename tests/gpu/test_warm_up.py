"""No Triton kernel compiles while an engine serves: start-up compiles every kernel a step can
launch. A cold compile takes about a second on the H100 host, and every running request waits
for it (benchmarks/h100-2026-11-26-s24.md: four mid-serving compiles of the attention kernel
held requests for 0.7-1.1 s each). Nor does serving grow the caching allocator's device
memory: start-up ran the step's tail at its largest, so its blocks are there (the first burst
after start-up made 26 device allocations, benchmarks/h100-2026-11-26-s25.md)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

# Run in a fresh process: kernels an earlier test compiled stay in Triton's memory, where a
# compile this engine would need goes unseen.
WORKLOAD = """
import json, random, sys
import torch, triton
from ostinato import LLM, SamplingParams

llm = LLM("random:qwen3-0.6b", max_model_len=1024, max_num_seqs=64, num_kv_blocks=4096,
          cuda_graph_mode=sys.argv[1])
compiled = []
def hook(*args, **kwargs):
    compiled.append(getattr(kwargs.get("fn"), "name", repr(kwargs.get("fn"))))
    return False
triton.knobs.runtime.jit_post_compile_hook = hook
device_allocs = torch.cuda.memory_stats()["num_device_alloc"]

rng = random.Random(0)
prompts = [[rng.randrange(2, 1000) for _ in range(rng.randint(40, 300))] for _ in range(24)]
greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=6, ignore_eos=True)
llm.generate(prompts, greedy, use_tqdm=False)  # fresh prompts, all at once
engine = llm.engine
for i, prompt in enumerate(prompts):  # again, one arriving per step: prefix hits beside decodes
    engine.add_request(prompt, sampled if i % 2 else greedy, f"again-{i}")
    engine.step()
while engine.has_unfinished_requests():
    engine.step()
llm.generate([p[: len(p) // 2] for p in prompts[:5]], sampled, use_tqdm=False)
device_allocs = torch.cuda.memory_stats()["num_device_alloc"] - device_allocs
print(json.dumps([compiled, llm.graph_report()["eager_warm_up_seconds"], device_allocs]))
"""


@pytest.mark.parametrize("mode", ["full_and_piecewise", "none"])
def test_no_kernel_compiles_after_start_up(mode):
    run = subprocess.run(
        [sys.executable, "-c", WORKLOAD, mode], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    compiled, warm_up_seconds, device_allocs = json.loads(run.stdout.strip().splitlines()[-1])
    assert compiled == [], f"compiled while serving in mode {mode}: {compiled}"
    assert warm_up_seconds > 0
    assert device_allocs == 0, f"{device_allocs} device allocations while serving in mode {mode}"
