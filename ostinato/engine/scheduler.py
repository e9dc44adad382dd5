"""Continuous batching with chunked prefill.

Each step packs the decode tokens of running requests first, then prefill chunks (of running
requests still prefilling, then of newly admitted ones) under `max_num_batched_tokens` and
`max_num_seqs`. When blocks run out, the most recently admitted request is preempted and will
recompute its tokens later.

A batch uses at most `max_loras` distinct LoRA adapters (the slots every rank holds). A waiting
request whose adapter does not fit waits for a later step; base-model requests behind it go
ahead, adapter requests behind it keep their place in the queue, so every adapter gets its turn
(the running requests of the adapters before it finish, and none of theirs overtake it).

With pipeline parallelism several batches are in flight at once (one per stage): a request
in flight is never scheduled again until its batch completes, and each batch takes at most
its share of the unfinished requests, so the stages get batches of similar size.

With speculative decoding a decode also verifies draft tokens: it computes its last token and
the drafts (blocks are allocated for them), and on completion only the accepted drafts count
as computed; the KV of rejected ones is overwritten by later steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from ostinato.config import EngineConfig
from ostinato.engine.block_manager import BlockManager
from ostinato.engine.sequence import Sequence, SequenceStatus
from ostinato.spec import make_proposer


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    query_lens: list[int]  # tokens of each sequence computed this step, drafts included
    drafts: list[list[int]] = field(default_factory=list)  # per sequence; empty: none at all

    def __post_init__(self) -> None:
        if not self.drafts:
            self.drafts = [[] for _ in self.seqs]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def uniform_query_len(self) -> int | None:
        """q when every request decodes its last token plus the same number of drafts, q - 1
        (a uniform decode batch)."""
        q = self.query_lens[0]
        is_decode = all(
            n == q and n == 1 + len(d) and s.num_computed_tokens + 1 == len(s)
            for s, n, d in zip(self.seqs, self.query_lens, self.drafts, strict=True)
        )
        return q if is_decode else None


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.num_microbatches = config.pipeline_parallel_size
        self.max_loras = config.max_loras
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.in_flight: set[Sequence] = set()
        self.num_preemptions = 0
        self.proposer = make_proposer(config)
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_model_len = config.max_model_len
        self._budget = 0
        self._scheduled: dict[Sequence, int] = {}
        self._drafts: dict[Sequence, list[int]] = {}
        self._adapters: set[str] = set()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """The next batch of requests not already in flight; None when there is none."""
        self._budget = self.max_num_batched_tokens
        self._scheduled, self._drafts = {}, {}
        self._adapters = set()
        cap = -(-(len(self.running) + len(self.waiting)) // self.num_microbatches)
        ready = [s for s in self.running if s not in self.in_flight]
        decodes = [s for s in ready if s.num_uncomputed_tokens == 1]
        prefills = [s for s in ready if s.num_uncomputed_tokens > 1]
        drafts = self._propose(decodes[:cap])
        for seq in decodes + prefills:
            if self._budget == 0 or len(self._scheduled) == cap:
                break
            # else preempted earlier this step
            if seq.status == SequenceStatus.RUNNING and self._adapter_fits(seq):
                self._schedule_running(seq, drafts.get(seq, []))
        skipped: list[Sequence] = []  # adapter requests that wait their turn
        while (
            self.waiting
            and self._budget > 0
            and len(self.running) < self.max_num_seqs
            and len(self._scheduled) < cap
        ):
            seq = self.waiting[0]
            if seq.lora_name is not None and (skipped or not self._adapter_fits(seq)):
                skipped.append(self.waiting.popleft())
            elif not self._admit(seq):
                break
        self.waiting.extendleft(reversed(skipped))
        if not self._scheduled:
            return None
        self.in_flight.update(self._scheduled)
        seqs = list(self._scheduled)
        drafts = [self._drafts.get(s, []) for s in seqs] if self._drafts else []
        return ScheduledBatch(seqs, list(self._scheduled.values()), drafts)

    def _propose(self, decodes: list[Sequence]) -> dict[Sequence, list[int]]:
        """Draft tokens of the decodes. When at least half of them have a proposal, every one
        verifies k drafts, those without one the last token repeated: the batch stays a uniform
        decode batch (a FULL graph of q = 1 + k), and a padded draft is verified like any other.
        Otherwise none speculates (a plain decode step): a lone chance match would make the
        whole batch verify k drafts that are mostly padding. Drafts never reach past
        max_model_len."""
        if self.proposer is None:
            return {}
        proposals, misses = {}, 0
        for seq in decodes:
            draft = proposals[seq] = self.proposer.propose(seq)
            misses += not draft
            if 2 * misses > len(decodes):  # more than half have none: the rest need not be asked
                return {}
        k = self.num_speculative_tokens
        return {
            seq: (draft or [seq.token_ids[-1]] * k)[: self.max_model_len - len(seq)]
            for seq, draft in proposals.items()
        }

    def complete(
        self, batch: ScheduledBatch, accepted: Mapping[str, int] | None = None, ran: bool = True
    ) -> None:
        """batch left flight. If it ran, its tokens are in the KV cache, but of each request's
        drafts only the accepted[request_id] first ones count (their tokens were appended);
        requests that ended while it was in flight are skipped (their blocks are gone)."""
        accepted = accepted or {}
        for seq, n, drafts in zip(batch.seqs, batch.query_lens, batch.drafts, strict=True):
            self.in_flight.discard(seq)
            if ran and seq.status is SequenceStatus.RUNNING:
                kept = accepted.get(seq.request_id, 0) if drafts else 0
                seq.num_computed_tokens += n - len(drafts) + kept
                self.block_manager.commit(seq)

    def _schedule_running(self, seq: Sequence, drafts: list[int]) -> None:
        """Allocate blocks for seq's next chunk (and its drafts, as far as the token budget
        and the free blocks allow), preempting the newest requests that are not in flight if
        needed."""
        n = min(seq.num_uncomputed_tokens, self._budget)
        drafts = drafts[: self._budget - n]
        if not self.block_manager.can_allocate(seq, n + len(drafts)):
            drafts = []  # drafts are a bet: never preempt a request for their blocks
        while not self.block_manager.can_allocate(seq, n + len(drafts)):
            victim = next(s for s in reversed(self.running) if s not in self.in_flight)
            self._preempt(victim)
            if victim is seq:
                return
        self.block_manager.allocate(seq, n + len(drafts))
        self._take(seq, n + len(drafts))
        if drafts:
            self._drafts[seq] = drafts

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

    def _adapter_fits(self, seq: Sequence) -> bool:
        name = seq.lora_name
        return name is None or name in self._adapters or len(self._adapters) < self.max_loras

    def _take(self, seq: Sequence, n: int) -> None:
        self._scheduled[seq] = n
        self._budget -= n
        if seq.lora_name is not None:
            self._adapters.add(seq.lora_name)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._budget += self._scheduled.pop(seq, 0)
        self._drafts.pop(seq, None)
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
        if self.proposer is not None:
            self.proposer.forget(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
