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
    """Drafts k tokens per request from its prompt and output. Keeps each request's tokens in
    a numpy array that grows with the request, so a step copies only the new tokens."""

    def __init__(self, k: int, ngram_min: int, ngram_max: int) -> None:
        self.k, self.ngram_min, self.ngram_max = k, ngram_min, ngram_max
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (tokens, filled)

    def propose(self, seq: Sequence) -> list[int]:
        """k draft tokens to follow seq's tokens, or [] when nothing matches."""
        tokens, filled = self._tokens.get(seq.request_id, (_EMPTY, 0))
        n = len(seq.token_ids)
        if n > len(tokens):  # doubling: appends cost O(1) each over a request's life
            grown = np.empty(max(n, 2 * len(tokens)), dtype=np.int64)
            grown[:filled] = tokens[:filled]
            tokens = grown
        tokens[filled:n] = seq.token_ids[filled:n]
        self._tokens[seq.request_id] = (tokens, n)
        return propose_ngram(tokens[:n], self.k, self.ngram_min, self.ngram_max)

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)


_EMPTY = np.empty(0, dtype=np.int64)
