"""Which batch sizes get a graph: two separate ladders (and the FULL prefill sizes, taken from
the token ladder), and padding to them."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from ostinato.config import EngineConfig

DENSE_UP_TO = 512  # the dense ladder's last size; above it, SPARSE_STEPS sizes per doubling
SPARSE_STEPS = 4
# Padded request counts of FULL prefill graphs. A padded request costs the large-tile
# attention launch one program per KV head that exits at once, so 2-4 requests share the
# graphs of 4, and 1 keeps a one-prompt step's launch exactly the eager one; (1, 2, 4) would
# add half as many graphs again (capture time, 4 MiB each in the reserve) for no gain.
PREFILL_REQS = (1, 4)


def default_ladder(cap: int) -> list[int]:
    """Dense up to 512: [1, 2, 4, 8] + 16..256 step 16 + 288..512 step 32 (decode batches and
    small mixed steps, where a padded token costs as much as a real one). Above 512, sparse:
    SPARSE_STEPS sizes per doubling (640..1024 step 128, 1280..2048 step 256, 2560..4096 step
    512, 5120..8192 step 1024, ...), so a prefill-sized step pads by under 25% (about 11% on
    average) while the whole ladder to 8192 adds only 16 graphs. Up to cap; cap itself is
    added when the ladder stops short of it, so every batch up to the limit can be graphed."""
    ladder = [1, 2, 4, 8, *range(16, 257, 16), *range(288, DENSE_UP_TO + 1, 32)]
    octave = DENSE_UP_TO
    while octave < cap:
        step = octave // SPARSE_STEPS
        ladder += range(octave + step, 2 * octave + 1, step)
        octave *= 2
    sizes = [s for s in ladder if s <= cap]
    return sizes if cap < 1 or cap in sizes else [*sizes, cap]


def ladder(cap: int, override: Iterable[int] | None) -> tuple[int, ...]:
    if override is None:
        return tuple(default_ladder(cap))
    return tuple(sorted({s for s in override if s <= cap}))


def lora_ladder(max_loras: int) -> tuple[int, ...]:
    """Active-adapter counts that get their own graphs: 0 (the base graphs), then powers of two
    below max_loras, and max_loras."""
    powers = [1 << i for i in range(max_loras.bit_length()) if 1 << i < max_loras]
    return (0, *powers, max_loras)


def padded_size(sizes: Sequence[int], n: int) -> int | None:
    """The smallest size >= n in an ascending list, or None when n is above them all."""
    i = bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class CapturePlan:
    """token_sizes: padded num_tokens of PIECEWISE graphs (and of FULL graphs in mode full),
    bounded by max_num_batched_tokens, and by max_capture_size when it is set.
    decode_sizes: padded num_reqs of FULL uniform-decode graphs (num_tokens = num_reqs * q),
    one ladder for every q in decode_query_lens, bounded by max_num_seqs and
    max_num_batched_tokens // the largest q.
    decode_query_lens: 1, and with speculative decoding also 1 + k (a verify step): a step
    where no request has a draft decodes one token each and replays the q = 1 graphs.
    lora_counts: active-adapter counts, one graph per size and count; (0,) without LoRA.
    prefill_token_sizes x prefill_reqs: FULL prefill graphs (num_tokens, num_reqs, None) for
    steps of few requests: the token sizes in [full_prefill_min_tokens,
    full_prefill_max_tokens] (so also capped by max_capture_size), request counts
    PREFILL_REQS (at most max_num_seqs). With so few padded requests the attention kernel,
    which picks its launch from tokens per request, takes its large-tile prefill launch, so
    one long prompt runs its whole step in one replay at the cost of its eager attention.
    Defaults 64..2048 tokens: from 64, every count has more than 8 tokens per padded request
    (at most 8 is the kernel's short-query, decode launch); above 2048 the GPU, not the host,
    sets a step's time (piecewise costs what eager does), and whole fresh prompts of 4096+
    tokens attend through SDPA, which no graph holds.
    """

    token_sizes: tuple[int, ...]
    decode_sizes: tuple[int, ...]
    max_num_seqs: int
    decode_query_lens: tuple[int, ...] = (1,)
    lora_counts: tuple[int, ...] = (0,)
    prefill_token_sizes: tuple[int, ...] = ()
    prefill_reqs: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config: EngineConfig) -> CapturePlan:
        k = config.num_speculative_tokens
        query_lens = (1, 1 + k) if k else (1,)
        max_tokens = min(
            config.max_capture_size or config.max_num_batched_tokens,
            config.max_num_batched_tokens,
        )
        max_reqs = min(config.max_num_seqs, config.max_num_batched_tokens // query_lens[-1])
        token_sizes = ladder(max_tokens, config.capture_sizes)
        low, high = config.full_prefill_min_tokens, config.full_prefill_max_tokens
        prefill = tuple(t for t in token_sizes if low <= t <= high)
        prefill_reqs = sorted({min(r, config.max_num_seqs) for r in PREFILL_REQS})
        return cls(
            token_sizes=token_sizes,
            decode_sizes=ladder(max_reqs, config.capture_sizes),
            max_num_seqs=config.max_num_seqs,
            decode_query_lens=query_lens,
            lora_counts=lora_ladder(config.max_loras) if config.enable_lora else (0,),
            prefill_token_sizes=prefill,
            prefill_reqs=tuple(prefill_reqs) if prefill else (),
        )

    def without_full_prefill(self) -> CapturePlan:
        return replace(self, prefill_token_sizes=(), prefill_reqs=())

    def pad_tokens(self, num_tokens: int) -> int | None:
        return padded_size(self.token_sizes, num_tokens)

    def pad_reqs(self, num_reqs: int) -> int | None:
        return padded_size(self.decode_sizes, num_reqs)

    def pad_loras(self, num_active_loras: int) -> int | None:
        return padded_size(self.lora_counts, num_active_loras)

    def pad_prefill_reqs(self, num_reqs: int) -> int | None:
        return padded_size(self.prefill_reqs, num_reqs)

    def in_prefill_range(self, num_tokens: int) -> bool:
        """Whether the token ladder pads num_tokens to a FULL prefill size."""
        return self.pad_tokens(num_tokens) in self.prefill_token_sizes
