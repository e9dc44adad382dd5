"""Attention backends: a small interface, a registry, and the implementations."""

from ostinato.attention.base import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    GraphSupport,
    get_attention_backend,
    register_attention_backend,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "GraphSupport",
    "get_attention_backend",
    "register_attention_backend",
]
