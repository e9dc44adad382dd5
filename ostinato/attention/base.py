"""The attention backend seam: what a backend must do and what it declares about graphs."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import ClassVar, NamedTuple, Protocol

import torch

from ostinato.context import AttentionMetadata


class GraphSupport(enum.Enum):
    """How much of a CUDA graph a backend's attention call may live inside."""

    ALWAYS = "always"  # any batch, sizes read on the device
    UNIFORM_DECODE = "uniform_decode"  # FULL graphs of uniform decode batches only (any q)
    SINGLE_TOKEN_DECODE = "single_token_decode"  # ... and only of one token per request
    NEVER = "never"  # must run outside graphs (PIECEWISE breaks around it)


class Rotation(NamedTuple):
    """The RoPE an attention call applies itself (AttentionPlan.rotates): the model's cos|sin
    table, float32 [max_position, head_dim], and with Qwen3's per-head norms the layer's q and
    k norm weights and their eps."""

    cos_sin_cache: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float


class AttentionPlan(Protocol):
    """One step's attention, called by every layer with its own tensors."""

    # whether a call may take `rotation`: a step of one token per request on a backend whose
    # kernel rotates and stores that token, saving the step a RoPE + store launch a layer
    rotates: bool

    def __call__(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: this step's, rotated
        v: torch.Tensor,
        out: torch.Tensor,  # like q, written in place
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        scale: float,
        rotation: Rotation | None = None,
    ) -> None:
        """Attend causally over the paged KV (this step's k/v are already stored in it; a
        backend may read them from k and v instead where nothing precedes them). With
        rotation (only where `rotates`), q and k come unrotated and k and v unstored: the
        call rotates both (after the norms), stores k and v at the step's slots, then
        attends."""


class AttentionBackend(ABC):
    name: ClassVar[str]
    graph_support: ClassVar[GraphSupport]

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> AttentionPlan:
        """The step's attention, built once when the step's forward context is made: what
        depends only on the batch (launch configuration, scratch) is worked out here or at the
        first layer's call, not again at every layer."""

    def warm_up_batches(
        self, num_heads: int, k_cache: torch.Tensor, width: int, max_reqs: int, max_tokens: int
    ) -> list[tuple[int, int]]:
        """(num_tokens, num_reqs) of the dummy batches an engine runs eagerly once at start-up
        so that no eager step compiles a kernel while serving (num_heads: of this rank;
        k_cache: one layer's; width: the block table's blocks per request). None by default."""
        return []


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
