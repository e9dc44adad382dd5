"""Workloads under which n-gram speculation proposes, verifies and accepts drafts with the tiny
checkpoints of helpers.py: the GPU graph tests (tests/gpu/test_spec_graphs.py) run them, and a
CPU test (tests/test_spec_engine.py) checks that they still speculate.

A tiny checkpoint's answer depends on its whole context, so it rarely repeats itself: even a
prompt that quotes the model's own answer (bench's copy workload) gets almost no draft accepted.
One context it answers exactly alike at every length: a single token repeated. Every attention
then reads one value, so the next token is a function of that token alone; a token that
predicts itself continues its run for ever, and every draft (the run again) stands.
"""

from __future__ import annotations

import torch

from ostinato import LLM, SamplingParams

K = 3
SPEC = {"speculative_method": "ngram", "num_speculative_tokens": K}
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 128, "max_num_seqs": 16}
VOCAB = 300  # prompt ids below the tokenizer's vocabulary (the model's is 320)


def self_repeating_tokens(llm: LLM) -> list[int]:
    """Tokens t the model answers [t, t] with t (so [t] * n too, for any n)."""
    probe = [[t, t] for t in range(2, VOCAB)]
    outs = llm.generate(probe, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    found = [p[0] for p, o in zip(probe, outs, strict=True) if o.token_ids == p[:1]]
    assert found, "no token answers its own run: mixed_workload would accept no drafts"
    return found


def mixed_workload(llm: LLM, repeating: list[int]) -> list[list[int]]:
    """Greedy outputs of nine prompts with repeated spans and random ones, long (chunked) and
    short (a vocabulary of 300 makes chance proposals frequent, and mostly wrong), beside seven
    runs of self-repeating tokens, from one token to a chunked 140. The runs accept every draft
    and, at 1 + K tokens a step, last about as many steps as the others, so most decode steps
    have a proposal for at least half their requests: uniform batches of q = 1 + K, of sizes
    that need padding as requests finish."""
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(2, VOCAB, (n,), generator=g).tolist()
    span = ids(13)
    prompts = [span * 9, ids(3), ids(40), span * 3, [7], ids(129), ids(11) * 2, ids(5), span]
    lengths = [10 + 3 * i for i in range(len(prompts))]
    for i, n in enumerate((1, 2, 5, 9, 21, 60, 140)):
        prompts.append([repeating[i % len(repeating)]] * n)
        lengths.append(40 + 12 * i)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def sampling_workload(llm: LLM) -> list[list[int]]:
    """Six seeded requests (temperature 0.8, top-k 50) of one prompt holding every token of the
    vocabulary in a random order: whatever a request samples occurred before, so every decode
    has a draft and decode steps verify 1 + K (the drafts are mostly rejected)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randperm(llm.engine.vocab_size, generator=g).tolist()
    params = [
        SamplingParams(temperature=0.8, top_k=50, seed=i, max_tokens=20 + i, ignore_eos=True)
        for i in range(6)
    ]
    return [o.token_ids for o in llm.generate([prompt] * 6, params, use_tqdm=False)]
