"""Verify draft tokens against the target model's distributions, one logits row each.

A draft is a point-mass proposal q = 1[x = d]. Rejection sampling accepts it with probability
min(1, p(d) / q(d)) = p(d); on rejection the token comes from the residual max(p - q, 0),
normalised, which is p with d removed. Drawing x ~ p and accepting d exactly when x = d is that
rule with the coin and the residual draw coupled into one draw: P(accept) = p(d), and a rejected
x is distributed as p given x != d, the residual. So the first token that is not an accepted
draft has probability p(x), as without speculation, and with the same draw of the race it is
the very token decoding without drafts would have sampled. Greedy rows accept a draft when it
is the argmax and otherwise emit the argmax, which is the same rule at zero temperature.
"""

from __future__ import annotations

import torch


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab]: target distributions; noise [rows, vocab]: Exp(1) draws. Each row's
    sample by an exponential race: argmax(p / E) with E ~ Exp(1) is distributed as p. A row's
    draft stands exactly when its sample is the draft (see accepted_prefix)."""
    return (probs / noise).argmax(dim=-1)


def accepted_prefix(tokens: list[int], drafts: list[int], start: int, num_drafts: int) -> int:
    """How many of the drafts in rows start .. start + num_drafts - 1 stand (a draft stands
    when its row sampled it): they count up to the first rejection (the tokens after it were
    drafted from a wrong context)."""
    a = 0
    while a < num_drafts and tokens[start + a] == drafts[start + a]:
        a += 1
    return a
