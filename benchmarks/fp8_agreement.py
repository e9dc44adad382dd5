"""How far FP8 weights move a model: greedy tokens of a bf16 run and a --quantization fp8 run of
the same (random) weights over N prompts x T tokens, position by position, and the cosine of
their logits at every position before the two runs first differ (the same context in both).

    python benchmarks/fp8_agreement.py --model random:llama-3.1-8b --prompts 32 --tokens 64

Prints one JSON line with the agreement, the cosine (minimum and mean) and a verdict against
issue 21's targets (>= 90% of positions, cosine >= 0.99). Runs eagerly, one prompt at a time, so
each step's logits row is the prompt's own.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from ostinato import LLM, SamplingParams
from ostinato.loader import load_hf_config


def run(model: str, quantization: str | None, prompts: list[list[int]], tokens: int):
    llm = LLM(model, quantization=quantization, enforce_eager=True, max_model_len=1024,
              max_num_seqs=1)  # fmt: skip
    model_ = llm.engine.executor.runner.model
    recorded: list[torch.Tensor] = []
    compute = model_.compute_logits

    def recording(hidden):
        logits = compute(hidden)
        recorded.append(logits[-1].float().cpu())
        return logits

    model_.compute_logits = recording
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs, logits = [], []
    for prompt in prompts:
        recorded.clear()
        outs.append(llm.generate([prompt], params, use_tqdm=False)[0].token_ids)
        logits.append(torch.stack(recorded[-tokens:]))
    llm.engine.shutdown()
    del llm, model_
    gc.collect()
    torch.cuda.empty_cache()
    return outs, logits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    vocab = load_hf_config(args.model).vocab_size
    prompts = [torch.randint(10, min(vocab, 30000), (args.prompt_len,), generator=g).tolist()
               for _ in range(args.prompts)]  # fmt: skip
    ref_tokens, ref_logits = run(args.model, None, prompts, args.tokens)
    fp8_tokens, fp8_logits = run(args.model, "fp8", prompts, args.tokens)
    same = sum(a == b for r, q in zip(ref_tokens, fp8_tokens, strict=True)
               for a, b in zip(r, q, strict=True))  # fmt: skip
    cosines = []
    for r, q, lr, lq in zip(ref_tokens, fp8_tokens, ref_logits, fp8_logits, strict=True):
        for i in range(len(r)):
            cosines.append(torch.nn.functional.cosine_similarity(lr[i], lq[i], dim=0).item())
            if r[i] != q[i]:
                break  # later positions have different contexts
    agreement = same / (args.prompts * args.tokens)
    print(json.dumps({
        "model": args.model, "prompts": args.prompts, "tokens": args.tokens,
        "token_agreement": agreement, "cosine_min": min(cosines),
        "cosine_mean": sum(cosines) / len(cosines), "positions_compared": len(cosines),
        "verdict": "met" if agreement >= 0.9 and min(cosines) >= 0.99 else "MISSED",
    }))  # fmt: skip


if __name__ == "__main__":
    main()
