"""No Triton kernel compiles while an engine serves: start-up compiles every kernel a step can
launch. A cold compile takes about a second on the H100 host, and every running request waits
for it (benchmarks/h100-2026-11-26-s24.md: four mid-serving compiles of the attention kernel
held requests for 0.7-1.1 s each). Nor does the first burst grow the caching allocator by the
step's tail: start-up ran it at its most rows (benchmarks/h100-2026-11-26-s25.md: without
that, the first burst of 80 prompts made 26 device allocations of ~36 MiB and waited ~60 ms
longer for its first tokens than the next burst)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

# Run in a fresh process: kernels an earlier test compiled stay in Triton's memory, where a
# compile this engine would need goes unseen.
WORKLOAD = """
import json, random, sys
import triton
from ostinato import LLM, SamplingParams
from ostinato.sampling_params import StructuredOutputsParams

llm = LLM("random:qwen3-0.6b", max_model_len=1024, max_num_seqs=64, num_kv_blocks=4096,
          cuda_graph_mode=sys.argv[1])
compiled = []
def hook(*args, **kwargs):
    compiled.append(getattr(kwargs.get("fn"), "name", repr(kwargs.get("fn"))))
    return False
triton.knobs.runtime.jit_post_compile_hook = hook

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
schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
constrained = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=schema))
llm.generate(prompts[:3], [constrained, greedy, constrained], use_tqdm=False)
print(json.dumps([compiled, llm.graph_report()["eager_warm_up_seconds"]]))
"""


@pytest.mark.parametrize("mode", ["full_and_piecewise", "none"])
def test_no_kernel_compiles_after_start_up(mode):
    run = subprocess.run(
        [sys.executable, "-c", WORKLOAD, mode], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    compiled, warm_up_seconds = json.loads(run.stdout.strip().splitlines()[-1])
    assert compiled == [], f"compiled while serving in mode {mode}: {compiled}"
    assert warm_up_seconds > 0


# 64 prompts of 16 tokens at once: one 1,024-token prefill step replayed from a graph, then
# decode steps, each sampling 64 rows (greedy, and random with top-p and logprobs).
BURST = """
import json, torch
from ostinato import LLM, SamplingParams

llm = LLM("random:qwen3-0.6b", max_model_len=1024, max_num_seqs=64, num_kv_blocks=4096)
segments = lambda: torch.cuda.memory_stats()["segment.large_pool.allocated"]
before = segments()
prompts = [[(7 * i + j) % 1000 + 2 for j in range(16)] for i in range(64)]
greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
sampled = SamplingParams(temperature=0.8, top_p=0.9, logprobs=2, max_tokens=4, ignore_eos=True)
llm.generate(prompts, [greedy if i % 2 else sampled for i in range(64)], use_tqdm=False)
print(json.dumps(segments() - before))
"""


def test_the_first_burst_finds_the_tails_memory_ready():
    run = subprocess.run([sys.executable, "-c", BURST], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    grown = json.loads(run.stdout.strip().splitlines()[-1])
    assert grown == 0, f"the first burst allocated {grown} new large device segments"
