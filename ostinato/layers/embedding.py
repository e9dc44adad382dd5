"""Token embedding and the LM head (which may share the embedding's weight), split over the
tensor ranks by vocabulary: each rank holds a contiguous slice of ceil(vocab / T) rows (the
last one padded with zero rows). With T = 1 they are a plain lookup and a plain matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ostinato.distributed.parallel import tp_group
from ostinato.layers.weights import Loadable, check_shape


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = tp_group()
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // self.tp.size)  # per rank, padded so T slices cover it
        self.start = self.tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.load
        self.weight.full_shape = (vocab_size, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Ids outside this rank's slice embed to zeros here; the all-reduce adds the rank
        that holds each id."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        elsewhere = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(elsewhere[:, None], 0.0))

    def load(self, param: nn.Parameter, loaded: Loadable, shard: int | None = None) -> None:
        check_shape(loaded, param.full_shape)
        held = max(0, min(self.rows, self.vocab_size - self.start))  # rows past the vocab: 0
        param.data[held:].zero_()
        if held:
            param.data[:held].copy_(loaded[self.start : self.start + held])


class LMHead(VocabEmbedding):
    """[n, hidden] -> logits [n, vocab]. Same weight layout as the embedding, so tying is
    sharing one Parameter. Each rank computes its slice's logits; an all-gather joins them."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[:, : self.vocab_size]
