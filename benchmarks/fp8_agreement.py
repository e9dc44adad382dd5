"""How far FP8 weights move a model: greedy tokens of a bf16 run and a --quantization fp8 run of
the same (random) weights over N prompts x T tokens, position by position, and the cosine of
their logits at every position before the two runs first differ (the same context in both).

    python benchmarks/fp8_agreement.py --model random:llama-3.1-8b --prompts 32 --tokens 64

A third run, the twin, keeps bf16 kernels but rounds each weight the way FP8 at load does
(quantise per row, dequantise): FP8 against the twin isolates the FP8 kernels (and, for
prompts longer than the GEMV's rows, the activations' per-token quantisation) from the
rounding of the weights, which the twin against bf16 measures alone. A scale bug shows as FP8
far from its twin; rounding amplified by the layers shows as the twin as far from bf16 as FP8.

Prints one JSON line with the agreement, the cosines (minimum and mean) of each pair and a
verdict against issue 21's targets (>= 90% of positions, cosine >= 0.99). Runs eagerly, one
prompt at a time, so each step's logits row is the prompt's own.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from ostinato import LLM, SamplingParams
from ostinato.kernels.fp8 import dequantize, quantize_rows
from ostinato.layers.linear import Linear
from ostinato.loader import load_hf_config


def round_weights_as_fp8(model: torch.nn.Module) -> None:
    """Every linear layer's weight through FP8 at load and back, in its own dtype."""
    for module in model.modules():
        if isinstance(module, Linear) and module.scale is None:
            for rows in module.weight.data.split(1024):  # a whole 8B matrix in fp32 would OOM
                rows.copy_(dequantize(*quantize_rows(rows), None).to(rows.dtype))


def run(model: str, arm: str, prompts: list[list[int]], tokens: int):
    quantization = "fp8" if arm == "fp8" else None
    llm = LLM(model, quantization=quantization, enforce_eager=True, max_model_len=1024,
              max_num_seqs=1, gpu_memory_utilization=0.5)  # fmt: skip
    model_ = llm.engine.executor.runner.model
    if arm == "twin":
        round_weights_as_fp8(model_)
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
    llm.shutdown()
    del llm, model_
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return outs, logits


def compare(a, b) -> dict:
    """Token agreement over all positions; logits cosine up to each prompt's first difference."""
    (a_tokens, a_logits), (b_tokens, b_logits) = a, b
    same = total = 0
    cosines = []
    for r, q, lr, lq in zip(a_tokens, b_tokens, a_logits, b_logits, strict=True):
        same += sum(x == y for x, y in zip(r, q, strict=True))
        total += len(r)
        for i in range(len(r)):
            cosines.append(torch.nn.functional.cosine_similarity(lr[i], lq[i], dim=0).item())
            if r[i] != q[i]:
                break  # later positions have different contexts
    return {
        "token_agreement": same / total,
        "cosine_min": min(cosines),
        "cosine_mean": sum(cosines) / len(cosines),
        "positions_compared": len(cosines),
    }


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
    runs = {arm: run(args.model, arm, prompts, args.tokens) for arm in ("bf16", "fp8", "twin")}
    fp8 = compare(runs["bf16"], runs["fp8"])
    print(json.dumps({
        "model": args.model, "prompts": args.prompts, "tokens": args.tokens,
        "prompt_len": args.prompt_len, **fp8,
        "fp8_vs_twin": compare(runs["twin"], runs["fp8"]),
        "twin_vs_bf16": compare(runs["bf16"], runs["twin"]),
        "verdict": "met" if fp8["token_agreement"] >= 0.9 and fp8["cosine_min"] >= 0.99
        else "MISSED",
    }))  # fmt: skip


if __name__ == "__main__":
    main()
