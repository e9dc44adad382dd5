"""Reference attention in plain torch over the paged cache; runs on CPU and CUDA, never graphed."""

from __future__ import annotations

from ostinato.attention.base import (
    AttentionBackend,
    AttentionPlan,
    GraphSupport,
    register_attention_backend,
)
from ostinato.context import AttentionMetadata
from ostinato.kernels.paged_attention import paged_attention_torch


@register_attention_backend
class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    graph_support = GraphSupport.NEVER  # loops over requests with host-side lengths

    def plan(self, meta: AttentionMetadata) -> AttentionPlan:
        return TorchAttentionPlan(meta)


class TorchAttentionPlan:
    rotates = False  # RoPE and the KV store stay the layer's

    def __init__(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    def __call__(self, q, k, v, out, k_cache, v_cache, scale: float, rotation=None) -> None:
        m = self.meta
        paged_attention_torch(
            q, k_cache, v_cache, out, m.query_start_loc_cpu, m.seq_lens_cpu, m.block_table, scale
        )
