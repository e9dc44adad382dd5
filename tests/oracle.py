"""The correctness oracle: Hugging Face transformers with the same weights."""

from __future__ import annotations

import random

import torch
import transformers

from ostinato import LLM, SamplingParams


def oracle_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Very different lengths (chunked prefill mixes them) and a shared 40-token prefix."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(2, vocab) for _ in range(n)]
    prefix = ids(40)
    return [ids(3), ids(90), ids(17), prefix + ids(5), ids(57), prefix + ids(9), [7]]


def hf_model(path, device: str = "cpu") -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(device).eval()


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=model.device)
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        outs.append(out[0, len(p) :].tolist())
    return outs


@torch.no_grad()
def hf_margins(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """For each generated token: how far its HF logit (given our prefix) is below HF's best."""
    ids = torch.tensor([prompt + tokens], device=model.device)
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(tokens, device=model.device)[:, None])[:, 0]
    return (logits.max(dim=-1).values - chosen).tolist()


def run_ostinato(
    path, prompts, max_new_tokens: int, **engine_kwargs
) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), max_num_batched_tokens=32, max_num_seqs=4, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    return llm, [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


MODES = ["none", "piecewise", "full", "full_decode_only", "full_and_piecewise"]


def mixed_workload(llm: LLM, vocab: int = 300) -> list[list[int]]:
    """Long prompts (chunked), short ones, and decode batches of sizes that need padding."""
    g = torch.Generator().manual_seed(0)
    lengths = [300, 3, 40, 7, 1, 129, 11, 5, 77, 2, 19]
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]
    params = [
        SamplingParams(temperature=0.0, max_tokens=10 + 3 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def engine(checkpoint, mode: str, **kw) -> LLM:
    kw = {"dtype": "float32", "max_num_batched_tokens": 128, "max_num_seqs": 16, **kw}
    kw.setdefault("gpu_memory_utilization", 0.25)
    return LLM(str(checkpoint), cuda_graph_mode=mode, max_capture_size=128, **kw)
