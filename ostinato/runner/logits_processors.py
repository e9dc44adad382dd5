"""What a request's settings do to its logits before sampling, on the device: min_tokens (EOS
and stop ids masked), logit_bias, then the penalties (repetition as in HF over prompt and
output, then frequency and presence over the output, as OpenAI defines them). Each runs only
when some row asks for it: a batch that asks for none launches no kernel here."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ostinato.runner.step import SamplingRow


def processes(rows: list[SamplingRow]) -> bool:
    """Whether some request asks process_logits for anything."""
    return any(r.min_tokens_left or r.history is not None or r.params.logit_bias for r in rows)


def process_logits(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    owners: list[SamplingRow],
    input_tokens: Callable[[], torch.Tensor] | None,
) -> torch.Tensor:
    """logits [logits rows, vocab] processed for each request (owners[i] owns logits row i;
    see SamplingRow). input_tokens() gives each logits row's input token on the device (a
    request's in-flight token, which only the device knows yet). Returns logits itself when
    no request asks for anything."""
    if not processes(rows):
        return logits
    offsets = [j for r in rows for j in range(1 + len(r.draft_token_ids))]
    masked = [i for i, o in enumerate(owners) if offsets[i] < o.min_tokens_left and o.banned]
    biased = [i for i, o in enumerate(owners) if o.params.logit_bias]
    penalized = [i for i, o in enumerate(owners) if o.history is not None]
    if not (masked or biased or penalized):
        return logits
    logits = logits.clone()
    if masked:
        rows, ids = _pairs(masked, lambda i: owners[i].banned)
        logits[_on(logits, rows), _on(logits, ids)] = float("-inf")
    if biased:
        rows, ids = _pairs(biased, lambda i: list(owners[i].params.logit_bias))
        bias = [b for i in biased for b in owners[i].params.logit_bias.values()]
        logits.index_put_((_on(logits, rows), _on(logits, ids)), _on(logits, bias), True)
    if penalized:
        _penalize(logits, [owners[i] for i in penalized], penalized, offsets, input_tokens)
    return logits


def _penalize(
    logits: torch.Tensor,
    owners: list[SamplingRow],
    rows: list[int],
    offsets: list[int],
    input_tokens: Callable[[], torch.Tensor],
) -> None:
    """Apply repetition, frequency and presence penalties to logits[rows] in place."""
    vocab = logits.shape[1]
    outputs = [
        o.history.output + o.draft_token_ids[: offsets[r]]
        for o, r in zip(owners, rows, strict=True)
    ]
    counts = _token_counts(outputs, vocab, logits)
    pending = [k for k, o in enumerate(owners) if o.history.pending]
    if pending:  # the in-flight token is the row's input token
        tokens = input_tokens()[_on(logits, [rows[k] for k in pending])]
        counts.index_put_(
            (_on(logits, pending), tokens), torch.ones_like(tokens, dtype=counts.dtype), True
        )
    index = _on(logits, rows)
    x = logits[index]
    params = [o.params for o in owners]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = (_token_counts([o.history.prompt for o in owners], vocab, logits) + counts) > 0
        penalty = _on(logits, [p.repetition_penalty for p in params])[:, None]
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    frequency = _on(logits, [p.frequency_penalty for p in params])[:, None]
    presence = _on(logits, [p.presence_penalty for p in params])[:, None]
    logits[index] = x - frequency * counts - presence * (counts > 0).float()


def _token_counts(
    token_lists: list[tuple[int, ...]], vocab: int, like: torch.Tensor
) -> torch.Tensor:
    """[len(token_lists), vocab] float: how often each list holds each token."""
    width = max(1, max(len(t) for t in token_lists))
    ids = np.full((len(token_lists), width), vocab, dtype=np.int64)  # padding: column `vocab`
    for k, tokens in enumerate(token_lists):
        ids[k, : len(tokens)] = tokens
    ids_t = _on(like, torch.from_numpy(ids))
    counts = torch.zeros(len(token_lists), vocab + 1, device=like.device)
    counts.scatter_add_(1, ids_t, torch.ones_like(ids_t, dtype=counts.dtype))
    return counts[:, :vocab]


def _pairs(rows: list[int], ids_of: Callable[[int], list[int]]) -> tuple[list[int], list[int]]:
    """(row, id) for every id of every row, as two flat lists."""
    pairs = [(i, t) for i in rows for t in ids_of(i)]
    return [i for i, _ in pairs], [t for _, t in pairs]


def on_device(device: torch.device, values: list | torch.Tensor) -> torch.Tensor:
    """values on `device` without waiting for the device: a copy from pageable host memory
    waits for the stream to drain, which would stall async scheduling's overlap."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _on(like: torch.Tensor, values: list | torch.Tensor) -> torch.Tensor:
    return on_device(like.device, values)
