"""Turn logits into tokens: one per request, or with draft tokens, the accepted drafts plus one."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ostinato.kernels.argmax import argmax_rows
from ostinato.kernels.bitmask import apply_token_bitmask
from ostinato.kernels.nucleus import top_p_mask
from ostinato.runner.deadline import wait_for
from ostinato.runner.logits_processors import on_device as _on
from ostinato.runner.logits_processors import process_logits, processes
from ostinato.runner.step import PromptRows, SamplingRow, TokenHistory
from ostinato.sampling_params import SamplingParams
from ostinato.speculative.rejection import accepted_prefix, race
from ostinato.structured.bitmask import TokenBitmask


@dataclass
class SamplerOutput:
    token_ids: list[list[int]]  # per sampling row: its accepted drafts, then one sampled token
    logprobs: list[list[dict[int, float]] | None]  # per sampling row, one entry per token
    # per PromptRows of the step: (its request, its first scored position, one entry per
    # position: top-N id -> logprob, and the prompt token's)
    prompt_logprobs: list[tuple[str, int, list[dict[int, float]]]] = field(default_factory=list)


@dataclass
class PromptScores:
    """The scored prompt positions of a step, on the device: top-N ids and logprobs (N the
    largest any request asked) and each position's prompt-token logprob."""

    rows: list[PromptRows]
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    chosen: torch.Tensor

    @classmethod
    def score(
        cls, rows: list[PromptRows], chunks: Iterator[torch.Tensor], device: torch.device
    ) -> PromptScores:
        """chunks: the logits of the rows' targets, in order, a few rows at a time."""
        n = max(1, max(r.num_logprobs for r in rows))
        targets = _on(device, [t for r in rows for t in r.targets])
        parts, done = [], 0
        for logits in chunks:
            logprobs = logits.float().log_softmax(dim=-1)
            top = logprobs.topk(n, dim=-1)
            chosen = logprobs.gather(1, targets[done : done + len(logits), None])[:, 0]
            parts.append((top.indices, top.values, chosen))
            done += len(logits)
        return cls(rows, *(torch.cat(p) for p in zip(*parts, strict=True)))

    def entries(self, host: list[list]) -> list[tuple[str, int, list[dict[int, float]]]]:
        top_ids, top_vals, chosen = host
        out, k = [], 0
        for r in self.rows:
            entries = []
            for target in r.targets:
                entry = dict(
                    zip(top_ids[k][: r.num_logprobs], top_vals[k][: r.num_logprobs], strict=True)
                )
                entry[target] = chosen[k]
                entries.append(entry)
                k += 1
            out.append((r.request_id, r.start, entries))
        return out


class SampledTokens:
    """One step's samples on their way to the host. `tokens` (the sampled token of every logits
    row) stays on the device, where async scheduling's next step reads the tokens it could not
    know yet; result() waits for the copies to the host and builds the per-request lists."""

    def __init__(
        self,
        rows: list[SamplingRow],
        tokens: torch.Tensor,
        logprobs: tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor] | None,
        prompt: PromptScores | None = None,
        timeout: float | None = None,
    ) -> None:
        self.rows, self.tokens, self.prompt, self.timeout = rows, tokens, prompt, timeout
        self._logprob_rows = logprobs[0] if logprobs is not None else []
        device_tensors = (tokens, *logprobs[1:]) if logprobs is not None else (tokens,)
        self._host = [t.to("cpu", non_blocking=True) for t in device_tensors]
        self._prompt_host = []
        if prompt is not None:
            scores = (prompt.top_ids, prompt.top_logprobs, prompt.chosen)
            self._prompt_host = [t.to("cpu", non_blocking=True) for t in scores]
        self._copied = None
        if tokens.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def result(self) -> SamplerOutput:
        if self._copied is not None:
            wait_for(self._copied, self.timeout, "the step's sampled tokens")
        tokens = self._host[0].tolist()
        picked = self._picked(tokens)
        out_tokens = [tokens[r.start : r.stop] for r in picked]  # accepted drafts are samples
        prompt = []
        if self.prompt is not None:
            prompt = self.prompt.entries([t.tolist() for t in self._prompt_host])
        return SamplerOutput(out_tokens, self._logprobs(tokens, picked), prompt)

    def _picked(self, tokens: list[int]) -> list[range]:
        """Per row, the logits rows whose samples it outputs: its accepted drafts, then one."""
        if not any(row.draft_token_ids for row in self.rows):
            return [range(i, i + 1) for i in range(len(self.rows))]
        drafts = [t for row in self.rows for t in (*row.draft_token_ids, -1)]
        picked, start = [], 0
        for row in self.rows:
            a = accepted_prefix(tokens, drafts, start, len(row.draft_token_ids))
            picked.append(range(start, start + a + 1))
            start += 1 + len(row.draft_token_ids)
        return picked

    def _logprobs(
        self, tokens: list[int], picked: list[range]
    ) -> list[list[dict[int, float]] | None]:
        """Top-N logprobs (N = the row's params.logprobs) and the chosen token's, from the
        logits row that produced each output token."""
        if not self._logprob_rows:
            return [None] * len(self.rows)
        where = {row: i for i, row in enumerate(self._logprob_rows)}
        top_ids, top_vals, chosen = (t.tolist() for t in self._host[1:])
        out: list[list[dict[int, float]] | None] = []
        for row, rows in zip(self.rows, picked, strict=True):
            n = row.params.logprobs
            if n is None:
                out.append(None)
                continue
            entries = []
            for j in rows:
                k = where[j]
                entry = dict(zip(top_ids[k][:n], top_vals[k][:n], strict=True))
                entry[tokens[j]] = chosen[k]
                entries.append(entry)
            out.append(entries)
        return out


class Sampler:
    """Samples by an exponential race, argmax(p / E) with E ~ Exp(1) per vocabulary entry.

    A seeded request's E for the token at position i of its sequence is drawn from a generator
    seeded by (seed, i) alone, so its output depends on nothing else: not on the batch it ran in,
    the steps it took, the process that sampled it, or whether drafts were verified (a draft
    stands when the position's sample equals it; see speculative/rejection.py).

    `timeout` (seconds; None: wait as long as it takes) bounds the host's wait for the
    samples: with several processes the step may wait on a peer that is stuck."""

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = timeout

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], bitmask: TokenBitmask | None = None
    ) -> SamplerOutput:
        return self.launch(logits, rows, bitmask).result()

    def launch(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        bitmask: TokenBitmask | None = None,
        input_tokens: Callable[[], torch.Tensor] | None = None,
        prompt: PromptScores | None = None,
    ) -> SampledTokens:
        """Sample on the device without waiting for it. logits [sum of 1 +
        len(row.draft_token_ids), vocab]: each row's logits rows in order (see SamplingRow);
        every logits row gets a sample, and a draft stands when its row sampled it.
        bitmask: the tokens each constrained logits row may take (structured outputs; see
        ostinato/structured/bitmask.py), applied first: logprobs are those of the masked
        distribution, and a draft the grammar forbids is rejected.
        input_tokens(): each logits row's input token on the device (penalties read a token
        still in flight there). Logprobs are taken before the request's penalties, bias,
        min_tokens and min_p change the logits."""
        if bitmask is None and _only_greedy_tokens(rows):
            # the argmax of the logits as they are: widening to float32 is exact, so the
            # token is the same without the cast kernel (4-14 us a step on the H100)
            return SampledTokens(rows, argmax_rows(logits), None, prompt, self.timeout)
        logits = logits.float()
        if bitmask is not None:
            data = _on(logits.device, torch.from_numpy(bitmask.data))
            apply_token_bitmask(logits, *bitmask.split(data))
        owners = [row for row in rows for _ in range(1 + len(row.draft_token_ids))]
        processed = process_logits(logits, rows, owners, input_tokens)
        if all(row.params.greedy for row in rows):
            tokens = argmax_rows(processed)
        else:
            tokens = self._sample(processed, owners)
        logprobs = self._logprobs(logits, owners, tokens)
        return SampledTokens(rows, tokens, logprobs, prompt, self.timeout)

    def _sample(self, logits: torch.Tensor, owners: list[SamplingRow]) -> torch.Tensor:
        """The sampled token of every logits row (owners[i] owns row i)."""
        device = logits.device
        temps = [1.0 if s.params.greedy else s.params.temperature for s in owners]
        scaled = logits / _on(device, temps)[:, None]
        if any(s.params.min_p > 0 for s in owners):
            scaled = _min_p(scaled, owners)
        if any(s.params.top_k != -1 or s.params.top_p < 1.0 for s in owners):
            scaled = _top_k_top_p(scaled, owners)
        noise = torch.empty_like(scaled).exponential_()
        _seeded_noise(owners, noise)
        sampled = race(scaled.softmax(dim=-1), noise)
        if not any(s.params.greedy for s in owners):
            return sampled
        greedy = _on(device, [s.params.greedy for s in owners])
        return torch.where(greedy, argmax_rows(logits), sampled)

    def _logprobs(
        self, logits: torch.Tensor, owners: list[SamplingRow], tokens: torch.Tensor
    ) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For the logits rows of requests that want logprobs: their top-N (N the largest
        asked) ids and logprobs, and each row's sampled token's logprob."""
        index = [i for i, s in enumerate(owners) if s.params.logprobs is not None]
        if not index:
            return None
        n = max(max(owners[i].params.logprobs for i in index), 1)
        rows = _on(logits.device, index)
        logprobs = logits[rows].log_softmax(dim=-1)
        top = logprobs.topk(n, dim=-1)
        chosen = logprobs.gather(1, tokens[rows][:, None])[:, 0]
        return index, top.indices, top.values, chosen


def _only_greedy_tokens(rows: list[SamplingRow]) -> bool:
    """Every request wants its greedy token and nothing else: no logprobs, nothing that
    changes its logits first."""
    return all(r.params.greedy and r.params.logprobs is None for r in rows) and not processes(rows)


def warm_up_rows(count: int) -> list[SamplingRow]:
    """count rows that take every path of the sampler but two: greedy beside random sampling
    with top-k, top-p, min-p, logprobs, a logit bias, min_tokens and penalties, and one seeded
    row (its noise is drawn on the host, a vocabulary's worth per row). The others, the
    nucleus mask over the whole vocabulary and the argmax of logits as they are, are taken by
    nucleus_rows and greedy_rows."""
    history = TokenHistory(prompt=(1, 2), output=(3,), pending=False)
    every = SamplingParams(
        temperature=0.7, top_k=8, top_p=0.9, min_p=0.05, logprobs=2, max_tokens=2,
        min_tokens=1, presence_penalty=0.5, repetition_penalty=1.1, logit_bias={5: 1.0},
    )  # fmt: skip
    kinds = [
        SamplingRow("greedy", SamplingParams(temperature=0.0), 0),
        SamplingRow("every", every, 1, history=history, banned=(0,), min_tokens_left=1),
    ]
    seeded = SamplingRow("seeded", SamplingParams(seed=0), 0)
    return [seeded, *(kinds[i % 2] for i in range(count - 1))]


def nucleus_rows(count: int) -> list[SamplingRow]:
    """count rows that ask for top-p alone, which takes the nucleus mask."""
    return [SamplingRow("nucleus", SamplingParams(top_p=0.9), 0)] * count


def greedy_rows(count: int) -> list[SamplingRow]:
    """count rows that ask for their greedy token alone."""
    return [SamplingRow("greedy", SamplingParams(temperature=0.0), 0)] * count


def _seeded_noise(owners: list[SamplingRow], noise: torch.Tensor) -> None:
    """Overwrite the Exp(1) rows of seeded requests with the draws of their positions: row j of
    a request's 1 + len(drafts) rows samples the token at position row.position + j."""
    start = 0
    while start < len(owners):
        row = owners[start]
        width = 1 + len(row.draft_token_ids)
        if row.params.seed is not None:
            draws = [_position_noise(row.params.seed, row.position + j, noise.shape[1])
                     for j in range(width)]  # fmt: skip
            noise[start : start + width] = _on(noise.device, torch.stack(draws))
        start += width


def _position_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{position}".encode()))
    return torch.empty(vocab).exponential_(generator=generator)


def _min_p(logits: torch.Tensor, owners: list[SamplingRow]) -> torch.Tensor:
    """Mask (to -inf) every token less likely than min_p times the row's most likely one."""
    log_min_p = _on(logits.device, [math.log(s.params.min_p) if s.params.min_p > 0 else -math.inf
                                    for s in owners])  # fmt: skip
    floor = logits.max(dim=-1, keepdim=True).values + log_min_p[:, None]
    return logits.masked_fill(logits < floor, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus. A sort of the
    whole vocabulary took 6.2 ms for 256 rows of 151,936 logits on the H100, as long as the
    decode step. So when every filtering row has a top_k, only the largest top_k candidates
    are ranked; when some row asks for top-p alone, each row's top-k is masked below its k-th
    largest logit and top_p_mask (kernels/nucleus.py: no sort from 64 rows on) the rest."""
    vocab = logits.shape[1]
    filters = [s.params.top_k > 0 or s.params.top_p < 1.0 for s in seqs]
    top_k = [min(s.params.top_k, vocab) if s.params.top_k > 0 else vocab for s in seqs]
    top_p = [s.params.top_p for s in seqs]
    width = max(k for k, f in zip(top_k, filters, strict=True) if f)
    if width == vocab:
        return top_p_mask(_top_k_mask(logits, top_k), _on(logits.device, top_p))
    ranked, order = logits.topk(width, dim=-1)
    ranks = torch.arange(width, device=logits.device)[None, :]
    drop = ranks >= _on(logits.device, top_k)[:, None]
    probs = ranked.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token when the tokens ranked above it already cover top_p.
    drop |= (probs.cumsum(dim=-1) - probs) >= _on(logits.device, top_p)[:, None]
    kept = torch.full_like(logits, float("-inf")).scatter_(
        1, order, ranked.masked_fill(drop, float("-inf"))
    )
    if all(filters):
        return kept
    return torch.where(_on(logits.device, filters)[:, None], kept, logits)


def _top_k_mask(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """-inf below each row's top_k-th largest logit (a row whose top_k is the vocabulary keeps
    everything; tokens tied with the k-th are kept with it)."""
    vocab = logits.shape[1]
    limited = [k < vocab for k in top_k]
    if not any(limited):
        return logits
    largest = logits.topk(max(k for k, c in zip(top_k, limited, strict=True) if c), dim=-1)
    rank = _on(logits.device, [k - 1 if c else 0 for k, c in zip(top_k, limited, strict=True)])
    kth = largest.values.gather(1, rank[:, None])
    kth = kth.masked_fill(~_on(logits.device, limited)[:, None], float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))
