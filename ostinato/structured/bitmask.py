"""Token bitmasks: one bit per vocabulary id (bit i % 32 of int32 word i // 32), 1 = allowed.

Filled on the host from each constrained request's grammar state, for the constrained logits
rows only and as wide as the tokenizer's vocabulary (the model's may be wider); applied to the
logits on the device before sampling (ostinato/kernels/bitmask.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Waking llguidance's thread pool costs more than a small vocabulary's masks (measured on a
# CPU: 0.1-5 ms for 4-32 rows of the byte tokenizer, against ~1 us a row one after another);
# a real tokenizer's mask takes tens of microseconds a row, which the threads share.
PARALLEL_FROM_VOCAB = 16384


@dataclass
class TokenBitmask:
    """The tokens a step's constrained logits rows may take: `rows` (int32 [k]) lists those
    rows, `bits` (int32 [k, words]) row i's allowed ids; ids from 32 * words on are never
    allowed, and logits rows not listed take any token. Both live in one buffer, `data`, so
    they reach the device in one copy."""

    data: np.ndarray  # int32 [_bits_start(k) + k * words]: rows, padding, then bits
    words: int
    num_rows: int

    @classmethod
    def for_rows(cls, rows: Sequence[int], words: int) -> TokenBitmask:
        """A mask of these logits rows, their bits still to be written."""
        k = len(rows)
        data = np.empty(_bits_start(k) + k * words, dtype=np.int32)
        data[:k] = rows
        return cls(data, words, k)

    def split(self, data: Any = None) -> tuple[Any, Any]:
        """(rows, bits) as views of `data` (default self.data; or its copy on a device)."""
        data = self.data if data is None else data
        k = self.num_rows
        return data[:k], data[_bits_start(k) :].reshape(k, self.words)

    @property
    def rows(self) -> np.ndarray:
        return self.split()[0]

    @property
    def bits(self) -> np.ndarray:
        return self.split()[1]


def words_for(vocab: int) -> int:
    """int32 words a row needs for one bit per id of a vocab of this size."""
    return -(-vocab // 32)


def _bits_start(num_rows: int) -> int:
    """Where the bits begin: after the rows, at a 16-byte boundary. On the device both views
    are then 16-byte aligned whatever the row count, so the bitmask kernel, which Triton
    specialises on its pointers' alignment, compiles once, not once per alignment."""
    return -(-num_rows // 4) * 4


def fill_bitmask(
    rows: Sequence[Any], matchers: Sequence[Any], tokenizer_vocab: int, executor: Any
) -> TokenBitmask | None:
    """The constrained logits rows of a step and what each allows; None when no row is
    constrained. rows[i] (a SamplingRow) owns 1 + len(its drafts) logits rows. A constrained
    request (its llguidance matcher in `matchers`, else None) has its row 0 allow what its
    grammar allows next, and its row j the tokens allowed after its first j drafts, as far as
    the grammar accepts the drafts: the rows after a draft it forbids are left unconstrained,
    since that draft is rejected (its masked sample cannot equal it) and they are never used.
    executor: llguidance's thread pool, which fills the rows without drafts in one call when
    the vocabulary is large enough to pay for waking it."""
    listed: list[int] = []  # the constrained logits rows, ascending
    plain: list[tuple[Any, int]] = []  # (matcher, its row of the mask) of rows without drafts
    drafted: list[tuple[Any, Sequence[int], int]] = []  # (matcher, drafts it accepts, first row)
    start = 0
    for row, matcher in zip(rows, matchers, strict=True):
        drafts = row.draft_token_ids
        if matcher is not None:
            if drafts:
                accepted = drafts[: matcher.validate_tokens(list(drafts))]
                drafted.append((matcher, accepted, len(listed)))
                listed.extend(range(start, start + len(accepted) + 1))
            else:
                plain.append((matcher, len(listed)))
                listed.append(start)
        start += 1 + len(drafts)
    if not listed:
        return None
    mask = TokenBitmask.for_rows(listed, words_for(tokenizer_vocab))
    bits = mask.bits
    row_bytes = bits.shape[1] * 4
    if len(plain) > 1 and tokenizer_vocab >= PARALLEL_FROM_VOCAB:  # one call over its threads
        executor.unsafe_compute_mask_ptr(plain, bits.ctypes.data, row_bytes, len(listed))
    else:
        for matcher, i in plain:
            matcher.unsafe_compute_mask_ptr(bits[i].ctypes.data, row_bytes)
    for matcher, accepted, first in drafted:
        for j in range(len(accepted) + 1):
            matcher.unsafe_compute_mask_ptr(bits[first + j].ctypes.data, row_bytes)
            if j < len(accepted):
                matcher.consume_token(accepted[j])
        matcher.rollback(len(accepted))  # the matcher ends where it began
    return mask
