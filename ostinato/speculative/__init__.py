"""Speculative decoding: proposers draft tokens on the driver (the scheduler asks them), the
sampling rank verifies the drafts in one forward pass (rejection.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ostinato.config import EngineConfig
from ostinato.engine.sequence import Sequence
from ostinato.speculative.ngram import NgramProposer


class Proposer(Protocol):
    def propose(self, seq: Sequence) -> list[int]:
        """num_speculative_tokens draft tokens to follow seq's tokens, or [] for none."""

    def forget(self, request_id: str) -> None:
        """The request ended: drop what is kept for it."""


PROPOSERS: dict[str, Callable[[EngineConfig], Proposer]] = {
    "ngram": lambda c: NgramProposer(c.num_speculative_tokens, c.ngram_min, c.ngram_max),
}


def make_proposer(config: EngineConfig) -> Proposer | None:
    """The configured proposer; None without speculative decoding."""
    if config.speculative_method is None:
        return None
    return PROPOSERS[config.speculative_method](config)
