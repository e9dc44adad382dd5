"""Pick the runtime mode and the padded graph key of each step."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from ostinato.graphs.modes import BatchDescriptor, CudaGraphMode
from ostinato.graphs.plan import CapturePlan

NONE, PIECEWISE, FULL = CudaGraphMode.NONE, CudaGraphMode.PIECEWISE, CudaGraphMode.FULL


class Dispatcher:
    """Keys for a resolved mode and its plan (both after compat.resolve).

    - Uniform decode (every request has query length q = plan.decode_query_len) with a separate
      decode routine: FULL key (num_reqs padded, num_tokens = num_reqs * q) when captured.
    - Otherwise the mixed mode by padded num_tokens: PIECEWISE key (num_tokens only), or in
      mode full a FULL key whose num_reqs is min(num_tokens, max_num_seqs): padded requests
      have zero lengths, so one graph serves any batch of up to that many tokens.
    - Otherwise NONE with the unpadded descriptor (eager).
    dispatch() only returns keys listed by descriptors(): capture exactly those.
    """

    def __init__(self, mode: CudaGraphMode, plan: CapturePlan) -> None:
        self.mode, self.plan = mode, plan
        q = plan.decode_query_len
        self._token_mode = mode.mixed_mode
        self._decode_keys = {
            r: BatchDescriptor(r * q, r, q) for r in plan.decode_sizes if mode.separate_decode
        }
        self._token_keys = {
            t: self._token_key(t) for t in plan.token_sizes if self._token_mode is not NONE
        }

    def _token_key(self, num_tokens: int) -> BatchDescriptor:
        if self._token_mode is FULL:
            return BatchDescriptor(num_tokens, min(num_tokens, self.plan.max_num_seqs), None)
        return BatchDescriptor.piecewise(num_tokens)

    def dispatch(
        self, num_tokens: int, num_reqs: int, uniform_query_len: int | None
    ) -> tuple[CudaGraphMode, BatchDescriptor]:
        if uniform_query_len == self.plan.decode_query_len and self._decode_keys:
            padded = self.plan.pad_reqs(num_reqs)
            if padded is not None:
                return FULL, self._decode_keys[padded]
        if self._token_keys:
            padded = self.plan.pad_tokens(num_tokens)
            if padded is not None:
                return self._token_mode, self._token_keys[padded]
        return NONE, BatchDescriptor(num_tokens, num_reqs, uniform_query_len)

    def descriptors(self) -> dict[CudaGraphMode, list[BatchDescriptor]]:
        """Every key dispatch() can return, per runtime mode, in ascending size."""
        keys: dict[CudaGraphMode, list[BatchDescriptor]] = {FULL: [], PIECEWISE: []}
        keys[FULL] += self._decode_keys.values()
        if self._token_keys:
            keys[self._token_mode] += self._token_keys.values()
        return keys

    def capture_sizes(self) -> dict[str, list[int]]:
        """Sizes per runtime mode: num_reqs of decode keys, num_tokens of token keys."""
        tokens = list(self._token_keys)
        return {
            "full": list(self._decode_keys) + (tokens if self._token_mode is FULL else []),
            "piecewise": tokens if self._token_mode is PIECEWISE else [],
        }

    def without(self, dropped: Iterable[BatchDescriptor]) -> Dispatcher:
        """The same dispatcher minus some keys (sizes whose capture failed)."""
        gone = set(dropped)
        kept = lambda keys, sizes: tuple(s for s in sizes if keys.get(s) not in gone)
        plan = replace(
            self.plan,
            decode_sizes=kept(self._decode_keys, self.plan.decode_sizes),
            token_sizes=kept(self._token_keys, self.plan.token_sizes),
        )
        return Dispatcher(self.mode, plan)
