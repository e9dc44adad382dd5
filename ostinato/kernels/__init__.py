"""Kernels: Triton on CUDA (and on CPU under TRITON_INTERPRET=1), plain torch otherwise.

Each public function has one signature for both paths and picks by the tensors' device.
"""

from ostinato.kernels.activation import silu_and_mul
from ostinato.kernels.norm import fused_add_rms_norm, rms_norm
from ostinato.kernels.paged_attention import PagedAttention, paged_attention
from ostinato.kernels.rope_store import rope_and_store

__all__ = [
    "PagedAttention",
    "fused_add_rms_norm",
    "paged_attention",
    "rms_norm",
    "rope_and_store",
    "silu_and_mul",
]
