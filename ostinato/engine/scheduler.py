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

With async scheduling the next batch is scheduled while the last one runs on the device: a
request in flight takes the next batch too (its next prefill chunk, or a decode of the token
its batch in flight samples, which the device fills in), unless that token certainly ends it
(max_tokens, max_model_len), or it verifies drafts (how many stand is not known yet). A request
that a stop token or string ends meanwhile has one token computed in vain. Requests in flight
are never preempted.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from ostinato.config import EngineConfig
from ostinato.engine.block_manager import BlockManager
from ostinato.engine.sequence import Sequence, SequenceStatus
from ostinato.speculative import make_proposer


@dataclass
class ScheduledBatch:
    """Requests and how many tokens of each run this step. `starts` (where each request's
    tokens begin) and `sampled` (whether its tokens reach its end, so it samples) are read off
    the requests when the batch is made, before it is in flight."""

    seqs: list[Sequence]
    query_lens: list[int]  # tokens of each sequence computed this step, drafts included
    drafts: list[list[int]] = field(default_factory=list)  # per sequence; empty: none at all
    starts: list[int] = field(init=False)
    sampled: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        if not self.drafts:
            self.drafts = [[] for _ in self.seqs]
        self.starts = [s.num_scheduled_tokens for s in self.seqs]
        self.sampled = [
            start + n - len(d) == len(s) + s.num_pending_tokens
            for s, start, n, d in zip(self.seqs, self.starts, self.query_lens, self.drafts,
                                      strict=True)
        ]  # fmt: skip

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def uniform_query_len(self) -> int | None:
        """q when every request decodes its last token plus the same number of drafts, q - 1
        (a uniform decode batch)."""
        q = self.query_lens[0]
        is_decode = all(
            n == q and n == 1 + len(d) and sampled
            for n, d, sampled in zip(self.query_lens, self.drafts, self.sampled, strict=True)
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
        self.in_flight: Counter[Sequence] = Counter()  # batches in flight per request
        self.async_scheduling = config.async_scheduling
        self._last_batch: set[Sequence] = set()  # the requests of the batch scheduled last
        self._verifying: set[Sequence] = set()  # requests whose batch in flight has drafts
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
        ready = [s for s in self.running if not self.in_flight[s] or self._may_continue(s)]
        decodes = [s for s in ready if s.num_uncomputed_tokens == 1]
        prefills = [s for s in ready if s.num_uncomputed_tokens > 1]
        drafts = self._propose(decodes[:cap])
        if drafts is None:  # speculation needs the tokens in flight first
            return None
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
        seqs = list(self._scheduled)
        drafts = [self._drafts.get(s, []) for s in seqs] if self._drafts else []
        batch = ScheduledBatch(seqs, list(self._scheduled.values()), drafts)
        for seq, n, sampled in zip(seqs, batch.query_lens, batch.sampled, strict=True):
            self.in_flight[seq] += 1
            seq.num_in_flight_tokens += n
            seq.num_pending_tokens += sampled
        self._verifying.update(self._drafts)
        self._last_batch = set(seqs)
        return batch

    def _may_continue(self, seq: Sequence) -> bool:
        """With async scheduling: whether a request in one batch in flight may take the next
        batch too; not when that batch verifies drafts of it (how many stand is unknown), nor
        when the token in flight could end it by length."""
        pending = seq.num_pending_tokens
        return (
            self.async_scheduling
            and self.in_flight[seq] == 1
            and seq in self._last_batch  # its next token's step is the one before this batch
            and seq not in self._verifying
            and seq.num_output_tokens + pending < seq.params.max_tokens
            and len(seq) + pending < self.max_model_len
        )

    def _propose(self, decodes: list[Sequence]) -> dict[Sequence, list[int]] | None:
        """Draft tokens of the decodes. When at least half of them have a proposal, every one
        verifies k drafts, those without one the last token repeated: the batch stays a uniform
        decode batch (a FULL graph of q = 1 + k), and a padded draft is verified like any other.
        Otherwise none speculates (a plain decode step): a lone chance match would make the
        whole batch verify k drafts that are mostly padding. Drafts never reach past
        max_model_len.

        With async scheduling a decode in flight proposes from its context without the token
        in flight. If the batch would speculate even so, None: wait for that token and draft
        from the whole context; else the batch runs plain, launched behind the one in flight
        (so text that repeats nothing decodes at async speed)."""
        if self.proposer is None:
            return {}
        proposals, misses = {}, 0
        for seq in decodes:
            draft = proposals[seq] = self.proposer.propose(seq)
            misses += not draft
            if 2 * misses > len(decodes):  # more than half have none: the rest need not be asked
                return {}
        if any(self.in_flight[seq] for seq in decodes):
            return None
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
        for seq, n, drafts, sampled in zip(
            batch.seqs, batch.query_lens, batch.drafts, batch.sampled, strict=True
        ):
            self.in_flight[seq] -= 1
            if not self.in_flight[seq]:
                del self.in_flight[seq]
                self._verifying.discard(seq)
            seq.num_in_flight_tokens -= n
            seq.num_pending_tokens -= sampled
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
            victim = next((s for s in reversed(self.running) if not self.in_flight[s]), None)
            if victim is None:  # every candidate is in flight: seq waits for a later step
                return
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
