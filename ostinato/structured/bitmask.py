"""Token bitmasks: one bit per vocabulary id (bit i % 32 of int32 word i // 32), 1 = allowed.

Filled on the host from each constrained request's grammar state; applied to the logits on
the device before sampling."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

ALL = -1  # an int32 word with every bit set
# Waking llguidance's thread pool costs more than a small vocabulary's masks (measured on a
# CPU: 0.1-5 ms for 4-32 rows of the byte tokenizer, against ~1 us a row one after another);
# a real tokenizer's mask takes tens of microseconds a row, which the threads share.
PARALLEL_FROM_VOCAB = 16384


def fill_bitmask(
    rows: Sequence[Any], matchers: Sequence[Any], words: int, tokenizer_vocab: int, executor: Any
) -> np.ndarray:
    """[logits rows, words] int32: rows[i] (a SamplingRow) owns 1 + len(its drafts) logits
    rows. An unconstrained request allows every token; a constrained one (its llguidance
    matcher in `matchers`, else None) allows what its grammar allows next, and its row j the
    tokens allowed after its first j drafts. Rows past a draft the grammar forbids allow every
    token: that draft is rejected (its masked sample cannot equal it), so they are never used.
    Ids from tokenizer_vocab on are never allowed in a constrained row."""
    num_rows = sum(1 + len(row.draft_token_ids) for row in rows)
    grammar_words = -(-tokenizer_vocab // 32)
    mask = np.full((num_rows, words), ALL, dtype=np.int32)
    allowed = np.zeros((num_rows, grammar_words), dtype=np.int32)  # what the matchers write
    plain: list[tuple[Any, int]] = []
    constrained: list[int] = []
    start = 0
    for row, matcher in zip(rows, matchers, strict=True):
        if matcher is not None:
            if row.draft_token_ids:
                used = _fill_drafts(matcher, row.draft_token_ids, allowed, start)
            else:
                plain.append((matcher, start))
                used = 1
            constrained.extend(range(start, start + used))
        start += 1 + len(row.draft_token_ids)
    if len(plain) > 1 and tokenizer_vocab >= PARALLEL_FROM_VOCAB:  # over llguidance's threads
        executor.unsafe_compute_mask_ptr(plain, allowed.ctypes.data, grammar_words * 4, num_rows)
    else:
        for matcher, row in plain:
            matcher.unsafe_compute_mask_ptr(allowed[row].ctypes.data, grammar_words * 4)
    if constrained:
        mask[constrained] = 0
        mask[constrained, :grammar_words] = allowed[constrained]
    return mask


def _fill_drafts(matcher: Any, drafts: Sequence[int], allowed: np.ndarray, start: int) -> int:
    """Rows of the drafts the grammar accepts, and of the token after them; the matcher ends
    where it began. Returns how many rows it filled."""
    valid = matcher.validate_tokens(list(drafts))
    for j in range(valid + 1):
        row = allowed[start + j]
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if j < valid:
            matcher.consume_token(drafts[j])
    matcher.rollback(valid)
    return valid + 1


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf in place. logits [rows, vocab] float,
    bitmask [rows, ceil(vocab / 32)] int32 on the same device."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1
    logits.masked_fill_(bits.flatten(1)[:, :vocab] == 0, float("-inf"))
