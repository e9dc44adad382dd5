"""Turn the last-token logits of each request into its next token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.runner.step import SamplingRow


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class Sampler:
    """Owns the random state of seeded requests (one CPU generator each, kept across steps
    until the request ends), so whichever process samples holds it."""

    def __init__(self) -> None:
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: tuple[str, ...]) -> None:
        for request_id in request_ids:
            self.generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> SamplerOutput:
        """logits [n, vocab] for seqs, in order."""
        logits = logits.float()
        params = [s.params for s in seqs]
        if all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, seqs)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(logits, token_list, seqs))

    def _generator(self, row: SamplingRow) -> torch.Generator | None:
        if row.params.seed is None:
            return None
        if row.request_id not in self.generators:
            self.generators[row.request_id] = torch.Generator().manual_seed(row.params.seed)
        return self.generators[row.request_id]

    def _sample(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
        device = logits.device
        temps = [1.0 if s.params.greedy else s.params.temperature for s in seqs]
        temps = torch.tensor(temps, device=device)
        scaled = logits / temps[:, None]
        if any(s.params.top_k != -1 or s.params.top_p < 1.0 for s in seqs):
            scaled = _top_k_top_p(scaled, seqs)
        probs = scaled.softmax(dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p, one noise draw per row.
        noise = torch.empty_like(probs).exponential_()
        for i, seq in enumerate(seqs):
            generator = self._generator(seq)
            if generator is not None:
                row = torch.empty(probs.shape[1]).exponential_(generator=generator)
                noise[i] = row.to(device)
        sampled = (probs / noise).argmax(dim=-1)
        greedy = torch.tensor([s.params.greedy for s in seqs], device=device)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    def _logprobs(
        self, logits: torch.Tensor, tokens: list[int], seqs: list[SamplingRow]
    ) -> list[dict[int, float] | None]:
        wanted = [s.params.logprobs for s in seqs]
        if all(n is None for n in wanted):
            return [None] * len(seqs)
        logprobs = logits.log_softmax(dim=-1)
        top = logprobs.topk(max(n or 0 for n in wanted) or 1, dim=-1)
        chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])
        top_ids, top_vals, chosen = top.indices.tolist(), top.values.tolist(), chosen.tolist()
        out: list[dict[int, float] | None] = []
        for i, n in enumerate(wanted):
            if n is None:
                out.append(None)
                continue
            entry = dict(zip(top_ids[i][:n], top_vals[i][:n], strict=True))
            entry[tokens[i]] = chosen[i][0]
            out.append(entry)
        return out


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
