"""The attention backend seam: what a backend must do and what it declares about graphs."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from ostinato.context import AttentionMetadata


class GraphSupport(enum.Enum):
    """How much of a CUDA graph a backend's attention call may live inside."""

    ALWAYS = "always"  # any batch, sizes read on the device
    UNIFORM_DECODE = "uniform_decode"  # FULL graphs of uniform decode batches only (any q)
    SINGLE_TOKEN_DECODE = "single_token_decode"  # ... and only of one token per request
    NEVER = "never"  # must run outside graphs (PIECEWISE breaks around it)


class AttentionBackend(ABC):
    name: ClassVar[str]
    graph_support: ClassVar[GraphSupport]

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        out: torch.Tensor,  # like q, written in place
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> None:
        """Store this step's k/v into the cache, then attend causally over the paged KV."""


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_attention_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    ATTENTION_BACKENDS[cls.name] = cls
    return cls


def get_attention_backend(name: str) -> type[AttentionBackend]:
    import ostinato.attention.torch_backend  # noqa: F401  (registers itself)
    import ostinato.attention.triton_backend  # noqa: F401

    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}: choose one of {sorted(ATTENTION_BACKENDS)}"
        )
    return ATTENTION_BACKENDS[name]
