"""The attention layer models call. It knows nothing of graphs: the runtime may turn the
attention call into a break between captured segments (see graphs/breakable.py)."""

from __future__ import annotations

import torch
from torch import nn

from ostinato.attention.base import Rotation
from ostinato.context import get_forward_context
from ostinato.graphs.breakable import breaking, run_outside_graph
from ostinato.layers.norm import RMSNorm
from ostinato.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_idx = layer_idx
        self.scale = head_dim**-0.5

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: RotaryEmbedding,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KH, D] -> [T, H, D]. RoPE (after the per-head norms, if given)
        and the KV store run in one kernel inside the captured part; only the attention over
        the cache may run outside it. A step whose plan rotates (decode) hands them to the
        attention launch instead, unless that call is a break between captured segments."""
        ctx = get_forward_context()
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        out = torch.empty_like(q)  # allocated before the break so its address is stable
        if ctx.attention.rotates and not breaking():  # a decode step: one launch does it all
            self._attend(q, k, v, out, _rotation(rotary, q_norm, k_norm))
            return out
        slots = ctx.attn_metadata.slot_mapping
        rotary.apply_and_store(
            positions, q, k, v, k_cache, v_cache, slots, q_norm, k_norm, ctx.rope
        )
        return run_outside_graph(self._attend, q, k, v, out=out)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        rotation: Rotation | None = None,
    ) -> None:
        ctx = get_forward_context()
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        ctx.attention(q, k, v, out, k_cache, v_cache, self.scale, rotation)


def _rotation(rotary: RotaryEmbedding, q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> Rotation:
    """The RoPE an attention launch applies itself, after Qwen3's per-head norms if given."""
    if q_norm is None:
        return Rotation(rotary.cos_sin_cache, None, None, 0.0)
    return Rotation(rotary.cos_sin_cache, q_norm.weight, k_norm.weight, q_norm.eps)
