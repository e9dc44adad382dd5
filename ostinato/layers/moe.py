"""A sparse mixture-of-experts block: a router picks each token's top-k experts on the device
(softmax, top-k, renormalised as the model defines it), the fused kernel (kernels/moe.py) runs
their SiLU MLPs. The router's projection takes the small-batch kernel where it pays (a decode
batch), as the dense projections do, and then normalises the layer's input itself and stores it
for the experts: the norm kernel before it is not launched.

Under tensor parallelism every rank holds every expert and its share of each expert's
intermediate features (gate|up rows and down columns, as a dense MLP splits them): each rank's
sum is partial, and one all-reduce completes it. Padded tokens of a graph (KV slot -1) are
routed to no expert.
"""

from __future__ import annotations

import torch
from torch import nn

from ostinato.context import current_forward_context
from ostinato.distributed.parallel import tp_group
from ostinato.kernels.gemv import gemv_normed, gemv_pays
from ostinato.kernels.moe import routed_moe
from ostinato.layers import linear
from ostinato.layers.linear import project
from ostinato.layers.norm import RMSNorm
from ostinato.layers.weights import Loadable, check_shape
from ostinato.layout import rank_share


def padding_slots(num_tokens: int) -> torch.Tensor | None:
    """This step's KV slots (-1: a graph's padded token), or None outside a step."""
    ctx = current_forward_context()
    meta = None if ctx is None else ctx.attn_metadata
    if meta is None or meta.slot_mapping.shape[0] != num_tokens:
        return None
    return meta.slot_mapping


class FusedMoE(nn.Module):
    """The experts' weights: w13 [E, 2 * I_rank, H] (gate rows, then up rows) and w2
    [E, H, I_rank]. Checkpoint shards: w13's 2e is expert e's gate_proj, 2e + 1 its up_proj;
    w2's e is its down_proj; shard None: the whole stacked tensor."""

    def __init__(
        self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int
    ) -> None:
        super().__init__()
        self.tp, self.top_k = tp_group(), top_k
        share = rank_share(intermediate_size, self.tp.rank, self.tp.size)
        self.rows = slice(share.start, share.stop)
        inter = len(share)
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden_size), requires_grad=False
        )
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter), requires_grad=False)
        self.w13.full_shape = (num_experts, 2 * intermediate_size, hidden_size)
        self.w2.full_shape = (num_experts, hidden_size, intermediate_size)
        self.w13.num_shards, self.w2.num_shards = 2 * num_experts, num_experts
        self.w13.weight_loader, self.w2.weight_loader = self.load_w13, self.load_w2
        self.inter, self.full_inter = inter, intermediate_size

    def forward(
        self,
        x: torch.Tensor,
        logits: torch.Tensor,  # the router's [T, E]
        renormalize: bool,
        slots: torch.Tensor | None = None,  # [T] KV slots: a token with slot -1 is padding
    ) -> torch.Tensor:
        out = routed_moe(x, logits, self.w13, self.w2, self.top_k, renormalize, slots)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)

    def load_w13(self, param: nn.Parameter, loaded: Loadable, shard: int | None = None) -> None:
        if shard is None:
            check_shape(loaded, param.full_shape)
            for s in range(param.num_shards):
                part = slice(s % 2 * self.full_inter, (s % 2 + 1) * self.full_inter)
                self.load_w13(param, loaded[s // 2][part], s)
            return
        check_shape(loaded, (self.full_inter, param.shape[2]))
        expert, part = divmod(shard, 2)
        param.data[expert, part * self.inter : (part + 1) * self.inter].copy_(loaded[self.rows])

    def load_w2(self, param: nn.Parameter, loaded: Loadable, shard: int | None = None) -> None:
        if shard is None:
            check_shape(loaded, param.full_shape)
            for e in range(param.num_shards):
                self.load_w2(param, loaded[e], e)
            return
        check_shape(loaded, (param.shape[1], self.full_inter))
        param.data[shard].copy_(loaded[:, self.rows])


class SparseMoeBlock(nn.Module):
    """gate (the router, [E, H], whole on every rank) and the experts."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size)
        self.top_k, self.renormalize = top_k, renormalize

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        norm: RMSNorm | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The layer's output for x; in a decoder layer (norm given) as LlamaMLP.forward: the
        residual stream x + residual normalised in, (output, the stream) out, the add pending."""
        if norm is not None:
            if linear.FUSE and gemv_pays(x, self.gate.weight, normed=True):
                logits, stream, normed = gemv_normed(
                    x, residual, norm.weight, norm.eps, self.gate.weight, normed_out=True
                )
                return self._experts(normed, logits), stream
            normed, residual = norm.stream(x, residual)
            return self(normed), residual
        return self._experts(x, project(x, self.gate.weight))

    def _experts(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return self.experts(x, logits, self.renormalize, padding_slots(x.shape[0]))
