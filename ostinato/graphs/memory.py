"""How much memory the graphs of a plan take, estimated before the KV cache is sized."""

from __future__ import annotations

from collections.abc import Iterable

from ostinato.graphs.modes import BatchDescriptor

PER_GRAPH_BYTES = 4 * 2**20  # each graph's own state (nodes, kernel parameters)
# the pool's first segments (the caching allocator's 20 MiB large and 2 MiB small ones), taken
# however small the model: 5 FULL graphs of a 2-layer test model took 34 MiB on the H100
POOL_BYTES = 32 * 2**20


def graph_memory_reserve(
    descriptors: Iterable[BatchDescriptor], activation: int, max_num_batched_tokens: int
) -> int:
    """Bytes to leave for the graph pool: graphs share one pool captured largest first, so it
    holds about twice the activations of the largest graph (activations grow with its tokens:
    `activation` is a max_num_batched_tokens step's peak), plus each graph's own state.
    Measured on the H100 (benchmarks/capture-h100.md): 0.20 GiB for qwen3-0.6b's 48 graphs up
    to 512 tokens, 0.27 GiB for llama-3.1-8b's. With LoRA every size is one graph per
    active-adapter count, and each counts."""
    descriptors = list(descriptors)
    largest = max((d.num_tokens for d in descriptors), default=0)
    if not largest:
        return 0
    share = min(1.0, largest / max_num_batched_tokens)
    return int(activation * share * 2) + len(descriptors) * PER_GRAPH_BYTES + POOL_BYTES
