"""Graph modes and the batch descriptor that keys every captured graph."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CudaGraphMode(enum.Enum):
    """A configured mode is a (decode mode, mixed mode) pair of the runtime modes
    NONE, PIECEWISE and FULL.

    FULL follows vLLM: one FULL routine for every batch, keyed by padded token count, so
    uniform decode batches use the same graphs as mixed ones (it needs a backend whose
    attention is capturable for any batch, GraphSupport.ALWAYS). The other graph modes keep
    a separate FULL routine for uniform decode batches, keyed by padded request count.
    """

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_DECODE_ONLY = "full_decode_only"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    @property
    def decode_mode(self) -> CudaGraphMode:
        return _PAIRS[self][0]

    @property
    def mixed_mode(self) -> CudaGraphMode:
        return _PAIRS[self][1]

    @property
    def separate_decode(self) -> bool:
        """Whether uniform decode batches get their own FULL graphs (keyed by num_reqs)."""
        return self.decode_mode is CudaGraphMode.FULL and self.mixed_mode is not CudaGraphMode.FULL

    @property
    def full_prefill(self) -> bool:
        """Whether steps of few requests get FULL graphs keyed by (num_tokens, num_reqs): the
        modes that graph every step and have FULL graphs (full, full_and_piecewise)."""
        return self.decode_mode is CudaGraphMode.FULL and self.mixed_mode is not CudaGraphMode.NONE


_M = CudaGraphMode
_PAIRS: dict[CudaGraphMode, tuple[CudaGraphMode, CudaGraphMode]] = {
    _M.NONE: (_M.NONE, _M.NONE),
    _M.PIECEWISE: (_M.PIECEWISE, _M.PIECEWISE),
    _M.FULL: (_M.FULL, _M.FULL),
    _M.FULL_DECODE_ONLY: (_M.FULL, _M.NONE),
    _M.FULL_AND_PIECEWISE: (_M.FULL, _M.PIECEWISE),
}
RUNTIME_MODES = (_M.NONE, _M.PIECEWISE, _M.FULL)


@dataclass(frozen=True, slots=True)
class BatchDescriptor:
    """The shape of one step after padding; the key of a captured graph.

    FULL keys are exact: attention inside the graph depends on num_reqs. PIECEWISE keys carry
    num_tokens only (num_reqs and uniform_query_len are None): attention runs outside the
    graph, so one piecewise graph serves any batch of that many (padded) tokens.
    """

    num_tokens: int
    num_reqs: int | None
    uniform_query_len: int | None
    num_active_loras: int = 0

    @classmethod
    def piecewise(cls, num_tokens: int, num_active_loras: int = 0) -> BatchDescriptor:
        return cls(num_tokens, None, None, num_active_loras)
