"""Pick the runtime mode and the padded graph key of each step."""

from __future__ import annotations

from collections.abc import Iterable

from ostinato.graphs.modes import BatchDescriptor, CudaGraphMode
from ostinato.graphs.plan import CapturePlan, padded_size

NONE, PIECEWISE, FULL = CudaGraphMode.NONE, CudaGraphMode.PIECEWISE, CudaGraphMode.FULL


class Dispatcher:
    """Keys for a resolved mode and its plan (both after compat.resolve).

    - Uniform decode (every request has query length q, q one of plan.decode_query_lens) with
      a separate decode routine: FULL key (num_reqs padded, num_tokens = num_reqs * q) when
      captured.
    - Otherwise, a step of at most plan.prefill_reqs[-1] requests whose padded num_tokens is
      a FULL prefill size, in modes full and full_and_piecewise: FULL key (num_tokens and
      num_reqs padded, uniform_query_len None). Padded requests have zero lengths and padded
      tokens belong to no request, so the graph computes the real ones only.
    - Otherwise the mixed mode by padded num_tokens: PIECEWISE key (num_tokens only), or in
      mode full a FULL key whose num_reqs is min(num_tokens, max_num_seqs): padded requests
      have zero lengths, so one graph serves any batch of up to that many tokens.
    - Otherwise NONE with the unpadded descriptor (eager).
    Every graph key also carries the number of adapters the step uses, padded up to an entry
    of plan.lora_counts; keys with 0 are the base graphs, which run no LoRA code at all.
    dispatch() only returns keys listed by descriptors(): capture exactly those. Keys in
    `dropped` (their capture failed) are left out: batches pad past them.
    """

    def __init__(
        self,
        mode: CudaGraphMode,
        plan: CapturePlan,
        dropped: frozenset[BatchDescriptor] = frozenset(),
    ) -> None:
        self.mode, self.plan, self.dropped = mode, plan, dropped
        self._token_mode = mode.mixed_mode
        decode_qs = plan.decode_query_lens if mode.separate_decode else ()
        # (q, adapter count) -> size -> key; adapter count -> size -> key
        self._decode_keys = {
            (q, k): _kept({r: BatchDescriptor(r * q, r, q, k) for r in plan.decode_sizes}, dropped)
            for q in decode_qs
            for k in plan.lora_counts
        }
        prefill_reqs = plan.prefill_reqs if mode.full_prefill else ()
        # (padded request count, adapter count) -> size -> key
        self._prefill_keys = {
            (r, k): _kept(
                {t: BatchDescriptor(t, r, None, k) for t in plan.prefill_token_sizes}, dropped
            )
            for r in prefill_reqs
            for k in plan.lora_counts
        }
        token_sizes = plan.token_sizes if self._token_mode is not NONE else ()
        self._token_keys = {
            k: _kept({t: self._token_key(t, k) for t in token_sizes}, dropped)
            for k in plan.lora_counts
        }
        self._decode_sizes = {qk: tuple(keys) for qk, keys in self._decode_keys.items()}
        self._token_sizes = {k: tuple(keys) for k, keys in self._token_keys.items()}
        self._prefill_sizes = {rk: tuple(keys) for rk, keys in self._prefill_keys.items()}

    def _token_key(self, num_tokens: int, num_loras: int) -> BatchDescriptor:
        if self._token_mode is FULL:
            num_reqs = min(num_tokens, self.plan.max_num_seqs)
            return BatchDescriptor(num_tokens, num_reqs, None, num_loras)
        return BatchDescriptor.piecewise(num_tokens, num_loras)

    def dispatch(
        self,
        num_tokens: int,
        num_reqs: int,
        uniform_query_len: int | None,
        num_active_loras: int = 0,
    ) -> tuple[CudaGraphMode, BatchDescriptor]:
        loras = self.plan.pad_loras(num_active_loras)
        sizes = self._decode_sizes.get((uniform_query_len, loras))
        if sizes:
            padded = padded_size(sizes, num_reqs)
            if padded is not None:
                return FULL, self._decode_keys[uniform_query_len, loras][padded]
        if self._prefill_sizes and self.plan.in_prefill_range(num_tokens):
            reqs = self.plan.pad_prefill_reqs(num_reqs)
            sizes = self._prefill_sizes.get((reqs, loras))
            if sizes:
                padded = padded_size(sizes, num_tokens)
                if padded is not None:
                    return FULL, self._prefill_keys[reqs, loras][padded]
        sizes = self._token_sizes.get(loras)
        if sizes:
            padded = padded_size(sizes, num_tokens)
            if padded is not None:
                return self._token_mode, self._token_keys[loras][padded]
        return NONE, BatchDescriptor(num_tokens, num_reqs, uniform_query_len, num_active_loras)

    def is_full_prefill(self, desc: BatchDescriptor) -> bool:
        """Whether desc is a FULL prefill key (of few requests, keyed by tokens and requests)."""
        keys = self._prefill_keys.get((desc.num_reqs, desc.num_active_loras))
        return keys is not None and keys.get(desc.num_tokens) == desc

    def descriptors(self) -> dict[CudaGraphMode, list[BatchDescriptor]]:
        """Every key dispatch() can return, per runtime mode, in ascending size per q and
        adapter count."""
        keys: dict[CudaGraphMode, list[BatchDescriptor]] = {FULL: [], PIECEWISE: []}
        for decode_keys in self._decode_keys.values():
            keys[FULL] += decode_keys.values()
        for prefill_keys in self._prefill_keys.values():
            keys[FULL] += prefill_keys.values()
        if self._token_mode is not NONE:
            for token_keys in self._token_keys.values():
                keys[self._token_mode] += token_keys.values()
        # in mode full with max_num_seqs <= 4 a prefill key is also a token key: capture once
        keys[FULL] = list(dict.fromkeys(keys[FULL]))
        return keys

    def capture_sizes(self) -> dict[str, list[int] | dict[str, list[int]]]:
        """Sizes per runtime mode: num_reqs of decode keys and num_tokens of token keys
        ("full", "piecewise"), the num_tokens and num_reqs of FULL prefill keys
        ("full_prefill": each token size with each request count), and the num_tokens of
        every FULL key ("full_tokens": with speculative decoding they reach max_num_seqs *
        (1 + k)). With LoRA each size is captured once per entry of plan.lora_counts."""
        tokens = sorted({t for sizes in self._token_sizes.values() for t in sizes})
        full_tokens = tokens if self._token_mode is FULL else []
        decode_reqs = sorted({r for sizes in self._decode_sizes.values() for r in sizes})
        prefill = {(t, r) for (r, _), sizes in self._prefill_sizes.items() for t in sizes}
        return {
            "full": decode_reqs + full_tokens,
            "piecewise": tokens if self._token_mode is PIECEWISE else [],
            "full_prefill": {
                "num_tokens": sorted({t for t, _ in prefill}),
                "num_reqs": sorted({r for _, r in prefill}),
            },
            "full_tokens": sorted({d.num_tokens for d in self.descriptors()[FULL]}),
        }

    def without(self, dropped: Iterable[BatchDescriptor]) -> Dispatcher:
        """The same dispatcher minus some keys (sizes whose capture failed)."""
        return Dispatcher(self.mode, self.plan, self.dropped | frozenset(dropped))


def _kept(
    keys: dict[int, BatchDescriptor], dropped: frozenset[BatchDescriptor]
) -> dict[int, BatchDescriptor]:
    return {size: key for size, key in keys.items() if key not in dropped}
