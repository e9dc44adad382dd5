"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the context's
last n tokens, so text that repeats earlier text (code edits, quotes, lists, loops) is drafted
without a second model."""

from __future__ import annotations

import numpy as np

from ostinato.engine.sequence import Sequence


def propose_ngram(tokens: np.ndarray, k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """k draft tokens for the context `tokens`, or [] when its last n tokens (ngram_min <= n
    <= ngram_max) never occurred earlier.

    The longest matching suffix wins, and of its occurrences the latest. The draft copies what
    followed it; where that runs into the end of the context, the copy repeats with the match's
    period (the context then ends in a loop, and the loop is the best guess)."""
    n_tokens = len(tokens)
    if n_tokens < 2:
        return []
    # ends: positions e < n_tokens - 1 where an earlier copy of the suffix of length n ends
    ends = np.flatnonzero(tokens[: n_tokens - 1] == tokens[n_tokens - 1])
    best, n = None, 1
    while ends.size:
        if n >= ngram_min:
            best = ends
        if n == ngram_max:
            break
        ends = ends[ends >= n]
        ends = ends[tokens[ends - n] == tokens[n_tokens - 1 - n]] if ends.size else ends
        n += 1
    if best is None:
        return []
    start = int(best[-1]) + 1
    draft = tokens[start : start + k].tolist()
    period = n_tokens - start
    for i in range(len(draft), k):
        draft.append(draft[i - period])
    return draft


class NgramProposer:
    """Drafts k tokens per request from its prompt and output. What it keeps per request
    (_Context) makes a step whose last token never occurred before cost one set lookup, and
    a search copy only the tokens that came since the last one."""

    def __init__(self, k: int, ngram_min: int, ngram_max: int) -> None:
        self.k, self.ngram_min, self.ngram_max = k, ngram_min, ngram_max
        self._contexts: dict[str, _Context] = {}  # request id -> its tokens as kept here

    def propose(self, seq: Sequence) -> list[int]:
        """k draft tokens to follow seq's tokens, or [] when nothing matches."""
        context = self._contexts.get(seq.request_id)
        if context is None:
            context = self._contexts[seq.request_id] = _Context()
        if not context.occurred_before_last(seq.token_ids):
            return []  # no suffix can match: no search (most steps of text that repeats nothing)
        tokens = context.array(seq.token_ids)
        return propose_ngram(tokens, self.k, self.ngram_min, self.ngram_max)

    def forget(self, request_id: str) -> None:
        self._contexts.pop(request_id, None)


class _Context:
    """One request's tokens (which only ever grow) as the proposer keeps them: the set of those
    before the last, updated each step with the new ones, and a numpy copy for the search,
    brought up to date only when a search runs (it grows by doubling, so appends cost O(1))."""

    __slots__ = ("seen", "num_seen", "tokens", "filled")

    def __init__(self) -> None:
        self.seen: set[int] = set()  # the first num_seen tokens
        self.num_seen = 0
        self.tokens = _EMPTY  # its first `filled` entries are the first tokens
        self.filled = 0

    def occurred_before_last(self, token_ids: list[int]) -> bool:
        """Whether the last token occurred earlier in token_ids."""
        last = len(token_ids) - 1
        if self.num_seen < last:
            self.seen.update(token_ids[self.num_seen : last])
            self.num_seen = last
        return token_ids[-1] in self.seen

    def array(self, token_ids: list[int]) -> np.ndarray:
        """token_ids as a numpy array (a view of the kept copy)."""
        n = len(token_ids)
        if n > len(self.tokens):
            grown = np.empty(max(n, 2 * len(self.tokens)), dtype=np.int64)
            grown[: self.filled] = self.tokens[: self.filled]
            self.tokens = grown
        self.tokens[self.filled : n] = token_ids[self.filled : n]
        self.filled = n
        return self.tokens[:n]


_EMPTY = np.empty(0, dtype=np.int64)
