"""Verify draft tokens against the target model's distributions, one logits row each.

A draft is a point-mass proposal q = 1[x = d]. Rejection sampling accepts it with probability
min(1, p(d) / q(d)) = p(d); on rejection the token comes from the residual max(p - q, 0),
normalised, which is p with d removed. So the first token that is not an accepted draft has
probability p(d) * 1[x = d] + (1 - p(d)) * p(x) 1[x != d] / (1 - p(d)) = p(x): sampling with
speculation draws from exactly the distribution it draws from without. Greedy rows accept a
draft when it is the argmax and otherwise emit the argmax, which is the same rule at zero
temperature.
"""

from __future__ import annotations

import torch


def rejection_sample(
    probs: torch.Tensor, drafts: torch.Tensor, noise: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [rows, vocab]: target distributions; drafts [rows]: the token each row verifies,
    -1 for a row with none (it only samples); noise [rows, vocab]: Exp(1) draws; uniforms
    [rows]: U[0, 1) draws.

    Returns (token, accepted) per row: accepted says the draft stands; token is the row's
    sample otherwise (from the residual where there is a draft, from probs where there is
    none). Sampling is an exponential race: argmax(p / E) with E ~ Exp(1) is distributed as p.
    """
    has_draft = drafts >= 0
    index = drafts.clamp(min=0)[:, None]
    p_draft = probs.gather(1, index).squeeze(1)
    residual = probs.scatter(1, index, torch.where(has_draft, 0.0, p_draft)[:, None])
    tokens = (residual / noise).argmax(dim=-1)
    return tokens, has_draft & (uniforms < p_draft)


def accepted_prefix(accepted: list[bool], start: int, num_drafts: int) -> int:
    """How many of the drafts in rows start .. start + num_drafts - 1 stand: they count up to
    the first rejection (the tokens after it were drafted from a wrong context)."""
    a = 0
    while a < num_drafts and accepted[start + a]:
        a += 1
    return a
