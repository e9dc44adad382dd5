"""Per-step state read by layers during a forward pass (set by the runner, read by attention
and LoRA layers)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged KV cache.

    Device tensors are slices of the runner's persistent buffers (graphs captured their
    addresses). Padded tokens have slot -1; padded requests have query length 0 and
    sequence length 0. The `_cpu` copies are exact host mirrors, for backends that run eagerly.
    """

    num_tokens: int  # padded token count, the first dimension of q
    num_reqs: int  # padded request count
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs], KV length including this step's tokens
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    # every real request's query length where the step's key fixes it: a FULL decode graph's
    # key, an eager step's own batch. None otherwise: a padded FULL graph of a token count
    # replays mixed batches, however its capture's dummy batch was cut
    uniform_query_len: int | None = None


@dataclass
class LoRAMetadata:
    """Which tokens use which adapter slot, grouped by adapter (see kernels/lora.py).

    Device tensors are slices of the runner's persistent buffers. num_active is the group
    count of the graph key (padded groups have count 0); tokens of no group use no adapter.
    """

    num_active: int
    token_indices: torch.Tensor  # int32 [num_tokens]: grouped tokens, group after group
    slots: torch.Tensor  # int32 [num_active]: the adapter slot of each group
    starts: torch.Tensor  # int32 [num_active]: where each group begins in token_indices
    counts: torch.Tensor  # int32 [num_active]: tokens in each group


@dataclass
class ForwardContext:
    """Made once per step (and per graph capture), so what attention derives from the batch
    alone is derived here once (the backend's plan), not again in every layer; so is the
    RoPE launch its layers share."""

    attn_metadata: AttentionMetadata | None
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per global layer index
    backend: Any  # AttentionBackend; typed loosely to keep this module import-free
    lora: LoRAMetadata | None = None  # None: no token of this step uses an adapter
    attention: Any = field(init=False)  # the backend's AttentionPlan for this step
    # RoPE launches its layers share, by what a layer's q, k and v may change (rope_and_store)
    rope: dict = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        meta = self.attn_metadata
        self.attention = None if meta is None else self.backend.plan(meta)


_context: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _context
    previous, _context = _context, ctx
    try:
        yield ctx
    finally:
        _context = previous


def current_forward_context() -> ForwardContext | None:
    """The step's context, or None outside a forward pass (a layer called on its own)."""
    return _context


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("attention ran outside a forward context: call the model via the runner")
    return _context
