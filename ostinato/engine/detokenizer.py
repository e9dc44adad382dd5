"""Incremental detokenization: decode only a short window per new token.

Decoding ids one by one breaks multi-byte characters and merged word pieces, and decoding the
whole output every step is quadratic; so decode the window since the last emitted text and
emit only what it added, holding back an incomplete character (U+FFFD at the end).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self.text_stopped = False  # cut at a stop string: nothing more is appended
        self._prefix_offset = 0  # window start: a few tokens back, for context
        self._read_offset = 0  # tokens already turned into text

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """token_ids: every output token so far. Returns the text they added; `final`
        flushes an incomplete character too, as the request ends."""
        decode = self.tokenizer.decode
        prefix = decode(token_ids[self._prefix_offset : self._read_offset])
        full = decode(token_ids[self._prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        new = full[len(prefix) :]
        self.text += new
        self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        return new


def cut_at_stop(detok: IncrementalDetokenizer, stops: list[str]) -> bool:
    """Cut detok's text at the first stop string it holds; True when one was found."""
    for stop in stops:
        at = detok.text.find(stop)
        if at != -1:
            detok.text = detok.text[:at]
            detok.text_stopped = True
            return True
    return False
