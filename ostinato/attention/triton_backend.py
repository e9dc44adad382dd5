"""Paged attention through the Triton kernels: every size is read on the device."""

from __future__ import annotations

from ostinato.attention.base import AttentionBackend, GraphSupport, register_attention_backend
from ostinato.context import AttentionMetadata
from ostinato.kernels import paged_attention, store_kv


@register_attention_backend
class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    graph_support = GraphSupport.ALWAYS

    def forward(self, q, k, v, out, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        paged_attention(
            q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table, scale
        )
