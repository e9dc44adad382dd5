"""Reference attention in plain torch over the paged cache; runs on CPU and CUDA, never graphed."""

from __future__ import annotations

from ostinato.attention.base import AttentionBackend, GraphSupport, register_attention_backend
from ostinato.context import AttentionMetadata
from ostinato.kernels.kv_store import store_kv_torch
from ostinato.kernels.paged_attention import paged_attention_torch


@register_attention_backend
class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    graph_support = GraphSupport.NEVER  # loops over requests with host-side lengths

    def forward(self, q, k, v, out, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        store_kv_torch(k, v, k_cache, v_cache, meta.slot_mapping)
        paged_attention_torch(
            q,
            k_cache,
            v_cache,
            out,
            meta.query_start_loc_cpu,
            meta.seq_lens_cpu,
            meta.block_table,
            scale,
        )
