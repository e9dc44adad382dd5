"""Reference attention in plain torch over the paged cache; runs on CPU and CUDA, never graphed."""

from __future__ import annotations

from functools import partial

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
        return partial(_attend, meta)


def _attend(meta: AttentionMetadata, q, k, v, out, k_cache, v_cache, scale: float) -> None:
    paged_attention_torch(
        q, k_cache, v_cache, out, meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.block_table,
        scale,
    )  # fmt: skip
