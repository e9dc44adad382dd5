"""Session 28: test_warm_up's BURST workload in this process (64 fresh 16-token prompts at once),
run with CUDA_LAUNCH_BLOCKING=1 so a faulting kernel raises where it launches."""
import json, sys, traceback
import torch
from ostinato import LLM, SamplingParams

mode = sys.argv[1] if len(sys.argv) > 1 else "full_and_piecewise"
llm = LLM("random:qwen3-0.6b", max_model_len=1024, max_num_seqs=64, num_kv_blocks=4096, cuda_graph_mode=mode)
prompts = [[(7 * i + j) % 1000 + 2 for j in range(16)] for i in range(64)]
greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
try:
    out = llm.generate(prompts, greedy, use_tqdm=False)
    torch.cuda.synchronize()
    print("ok", mode, out[0].outputs[0].token_ids if hasattr(out[0], "outputs") else "")
except Exception:
    traceback.print_exc()
