"""Kernels: Triton on CUDA (and on CPU under TRITON_INTERPRET=1), plain torch otherwise.

Each public function has one signature for both paths and picks by the tensors' device.
"""

from ostinato.kernels.activation import silu_and_mul
from ostinato.kernels.kv_store import store_kv
from ostinato.kernels.norm import fused_add_rms_norm, rms_norm
from ostinato.kernels.paged_attention import paged_attention
from ostinato.kernels.qk_norm_rope import qk_norm_rope
from ostinato.kernels.rope import rotary

__all__ = [
    "fused_add_rms_norm",
    "paged_attention",
    "qk_norm_rope",
    "rms_norm",
    "rotary",
    "silu_and_mul",
    "store_kv",
]
