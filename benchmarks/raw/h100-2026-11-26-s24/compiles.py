"""Session 24, exploratory: Triton compiles after start-up with ngram speculation (k=3) and
with structured outputs, on random:qwen3-0.6b (prompts that repeat, so drafts are accepted)."""
import json, random, sys
import triton
from ostinato import LLM, SamplingParams
from ostinato.sampling_params import StructuredOutputsParams

kind = sys.argv[1]
extra = dict(speculative_method="ngram", num_speculative_tokens=3) if kind == "spec" else {}
llm = LLM("random:qwen3-0.6b", max_model_len=1024, max_num_seqs=64, num_kv_blocks=4096, **extra)
compiled = []
triton.knobs.runtime.jit_post_compile_hook = lambda *a, **kw: compiled.append(getattr(kw.get("fn"), "name", "?")) or False
rng = random.Random(0)
base = [rng.randrange(2, 1000) for _ in range(60)]
prompts = [base * 3 + [rng.randrange(2, 1000) for _ in range(rng.randint(1, 40))] for _ in range(16)]
if kind == "structured":
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=json.dumps(schema)))
              if i % 2 else SamplingParams(max_tokens=8, ignore_eos=True) for i in range(16)]
else:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
llm.generate(prompts, params, use_tqdm=False)
engine = llm.engine
for i, p in enumerate(prompts):
    engine.add_request(p, params[i] if isinstance(params, list) else params, f"again-{i}")
    engine.step()
while engine.has_unfinished_requests():
    engine.step()
print(kind, "compiled after start-up:", compiled, "warm-up s", llm.graph_report()["eager_warm_up_seconds"])
