"""Turn logits into tokens: one per request, or with draft tokens, the accepted drafts plus one."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from ostinato.runner.step import SamplingRow
from ostinato.spec.rejection import accepted_prefix, rejection_sample


@dataclass
class SamplerOutput:
    token_ids: list[list[int]]  # per sampling row: its accepted drafts, then one sampled token
    logprobs: list[list[dict[int, float]] | None]  # per sampling row, one entry per token


class Sampler:
    """Samples by an exponential race, argmax(p / E) with E ~ Exp(1) per vocabulary entry.

    A seeded request's E for the token at position i of its sequence is drawn from a generator
    seeded by (seed, i) alone, so its output depends on nothing else: not on the batch it ran in,
    the steps it took, the process that sampled it, or whether drafts were verified (a draft
    stands when the position's sample equals it; see spec/rejection.py)."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits [sum of 1 + len(row.draft_token_ids), vocab]: each row's logits rows in
        order (see SamplingRow)."""
        logits = logits.float()
        owners = [row for row in rows for _ in range(1 + len(row.draft_token_ids))]
        speculating = any(row.draft_token_ids for row in rows)
        drafts = [t for row in rows for t in (*row.draft_token_ids, -1)] if speculating else []
        if all(row.params.greedy for row in rows):  # verified on the host: no more GPU work
            token_list = logits.argmax(dim=-1).tolist()
            accepted_list = (
                [d == t for d, t in zip(drafts, token_list, strict=True)] if drafts else []
            )
        else:
            tokens, accepted = self._sample(logits, owners, drafts)
            if accepted is None:
                token_list, accepted_list = tokens.tolist(), []
            else:  # one device-to-host copy
                token_list, accepted_list = torch.stack((tokens, accepted.long())).tolist()
        out_tokens, out_rows, start = [], [], 0
        for row in rows:
            a = accepted_prefix(accepted_list, start, len(row.draft_token_ids))
            out_tokens.append([*row.draft_token_ids[:a], token_list[start + a]])
            out_rows.append(range(start, start + a + 1))
            start += 1 + len(row.draft_token_ids)
        return SamplerOutput(out_tokens, self._logprobs(logits, rows, out_tokens, out_rows))

    def _sample(
        self, logits: torch.Tensor, owners: list[SamplingRow], draft_list: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sampled tokens per logits row (owners[i] owns row i), and with drafts (one per
        row, -1 for none) whether each row's draft stands (rejection sampling)."""
        device = logits.device
        drafts = torch.tensor(draft_list, device=device) if draft_list else None
        temps = [1.0 if s.params.greedy else s.params.temperature for s in owners]
        scaled = logits / torch.tensor(temps, device=device)[:, None]
        if any(s.params.top_k != -1 or s.params.top_p < 1.0 for s in owners):
            scaled = _top_k_top_p(scaled, owners)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        _seeded_noise(owners, noise)
        greedy = torch.tensor([s.params.greedy for s in owners], device=device)
        argmax = logits.argmax(dim=-1)
        if drafts is None:
            return torch.where(greedy, argmax, (probs / noise).argmax(dim=-1)), None
        sampled, accepted = rejection_sample(probs, drafts, noise)
        return (
            torch.where(greedy, argmax, sampled),
            torch.where(greedy, drafts == argmax, accepted),
        )

    def _logprobs(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        tokens: list[list[int]],
        picked: list[range],
    ) -> list[list[dict[int, float]] | None]:
        """Top-N logprobs (N = the row's params.logprobs) and the chosen token's, from the
        logits row that produced each output token."""
        wanted = [row.params.logprobs for row in rows]
        if all(n is None for n in wanted):
            return [None] * len(rows)
        index = [i for r in picked for i in r]
        flat = [t for ts in tokens for t in ts]
        device = logits.device
        logprobs = logits[torch.tensor(index, device=device)].log_softmax(dim=-1)
        top = logprobs.topk(max(n or 0 for n in wanted) or 1, dim=-1)
        chosen = logprobs.gather(1, torch.tensor(flat, device=device)[:, None])
        top_ids, top_vals, chosen = top.indices.tolist(), top.values.tolist(), chosen.tolist()
        out: list[list[dict[int, float]] | None] = []
        k = 0
        for n, ts in zip(wanted, tokens, strict=True):
            if n is None:
                out.append(None)
                k += len(ts)
                continue
            entries = []
            for t in ts:
                entry = dict(zip(top_ids[k][:n], top_vals[k][:n], strict=True))
                entry[t] = chosen[k][0]
                entries.append(entry)
                k += 1
            out.append(entries)
        return out


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
            noise[start : start + width] = torch.stack(draws).to(noise.device)
        start += width


def _position_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{position}".encode()))
    return torch.empty(vocab).exponential_(generator=generator)


def _top_k_top_p(logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus."""
    device = logits.device
    vocab = logits.shape[1]
    top_k = torch.tensor([s.params.top_k if s.params.top_k > 0 else vocab for s in seqs])
    top_p = torch.tensor([s.params.top_p for s in seqs], device=device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= top_k.to(device)[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token when the tokens ranked above it already cover top_p.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
