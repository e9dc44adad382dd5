"""Paged attention through the Triton kernels: every size is read on the device."""

from __future__ import annotations

from ostinato.attention.base import (
    AttentionBackend,
    AttentionPlan,
    GraphSupport,
    register_attention_backend,
)
from ostinato.context import AttentionMetadata
from ostinato.kernels import PagedAttention


@register_attention_backend
class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    graph_support = GraphSupport.ALWAYS

    def plan(self, meta: AttentionMetadata) -> AttentionPlan:
        return TritonAttentionPlan(meta)


class TritonAttentionPlan:
    """A PagedAttention per layer shape (every layer of a model has the same one), made at the
    first layer's call and launched by the rest."""

    def __init__(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.launches: dict[tuple, PagedAttention] = {}

    def __call__(self, q, out, k_cache, v_cache, scale: float) -> None:
        key = (q.shape, q.stride(), out.stride(), k_cache.stride(), q.dtype, scale)
        launch = self.launches.get(key)
        if launch is None:
            m = self.meta
            launch = PagedAttention(
                q, out, k_cache, m.query_start_loc, m.seq_lens, m.block_table, scale
            )
            self.launches[key] = launch
        launch(q, k_cache, v_cache, out)
