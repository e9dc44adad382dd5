"""Continuous batching with chunked prefill.

Each step packs the decode tokens of running requests first, then prefill chunks (of running
requests still prefilling, then of newly admitted ones) under `max_num_batched_tokens` and
`max_num_seqs`. When blocks run out, the most recently admitted request is preempted and will
recompute its tokens later.

With pipeline parallelism several batches are in flight at once (one per stage): a request
in flight is never scheduled again until its batch completes, and each batch takes at most
its share of the unfinished requests, so the stages get batches of similar size.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ostinato.config import EngineConfig
from ostinato.engine.block_manager import BlockManager
from ostinato.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    query_lens: list[int]  # tokens of each sequence computed this step

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def uniform_query_len(self) -> int | None:
        """q when every request decodes the same number of tokens (a uniform decode batch)."""
        q = self.query_lens[0]
        is_decode = all(
            n == q and s.num_computed_tokens + n == len(s)
            for s, n in zip(self.seqs, self.query_lens, strict=True)
        )
        return q if is_decode and q == 1 else None


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.num_microbatches = config.pipeline_parallel_size
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.in_flight: set[Sequence] = set()
        self.num_preemptions = 0
        self._budget = 0
        self._scheduled: dict[Sequence, int] = {}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """The next batch of requests not already in flight; None when there is none."""
        self._budget = self.max_num_batched_tokens
        self._scheduled: dict[Sequence, int] = {}
        cap = -(-(len(self.running) + len(self.waiting)) // self.num_microbatches)
        ready = [s for s in self.running if s not in self.in_flight]
        decodes = [s for s in ready if s.num_uncomputed_tokens == 1]
        prefills = [s for s in ready if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            if self._budget == 0 or len(self._scheduled) == cap:
                break
            if seq.status == SequenceStatus.RUNNING:  # else preempted earlier this step
                self._schedule_running(seq)
        while (
            self.waiting
            and self._budget > 0
            and len(self.running) < self.max_num_seqs
            and len(self._scheduled) < cap
        ):
            if not self._admit(self.waiting[0]):
                break
        if not self._scheduled:
            return None
        self.in_flight.update(self._scheduled)
        return ScheduledBatch(list(self._scheduled), list(self._scheduled.values()))

    def complete(self, batch: ScheduledBatch, ran: bool = True) -> None:
        """batch left flight. If it ran, its tokens are in the KV cache; requests that ended
        while it was in flight are skipped (their blocks are gone)."""
        for seq, n in zip(batch.seqs, batch.query_lens, strict=True):
            self.in_flight.discard(seq)
            if ran and seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens += n
                self.block_manager.commit(seq)

    def _schedule_running(self, seq: Sequence) -> None:
        """Allocate blocks for seq's next chunk, preempting the newest requests that are not
        in flight if needed."""
        n = min(seq.num_uncomputed_tokens, self._budget)
        while not self.block_manager.can_allocate(seq, n):
            victim = next(s for s in reversed(self.running) if s not in self.in_flight)
            self._preempt(victim)
            if victim is seq:
                return
        self.block_manager.allocate(seq, n)
        self._take(seq, n)

    def _admit(self, seq: Sequence) -> bool:
        bm = self.block_manager
        bm.allocate_cached_prefix(seq)
        n = min(seq.num_uncomputed_tokens, self._budget)
        if not bm.can_allocate(seq, n):
            bm.free(seq)  # a waiting request holds no blocks, or it could starve the running ones
            seq.num_computed_tokens = seq.num_cached_tokens = 0
            return False
        bm.allocate(seq, n)
        bm.prefix_queries += len(seq)
        bm.prefix_hits += seq.num_cached_tokens
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._take(seq, n)
        return True

    def _take(self, seq: Sequence, n: int) -> None:
        self._scheduled[seq] = n
        self._budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._budget += self._scheduled.pop(seq, 0)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a request (finished or aborted) and give its blocks back."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
