"""Block manager and scheduler invariants, driven without a model."""

import random

import pytest

from ostinato.config import EngineConfig
from ostinato.engine.block_manager import BlockManager, block_hash
from ostinato.engine.scheduler import Scheduler
from ostinato.engine.sequence import Sequence, SequenceStatus
from ostinato.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks: int, max_tokens: int = 16, max_seqs: int = 8, **kw):
    config = EngineConfig(
        device="cpu", block_size=BS, max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs, **kw
    )
    bm = BlockManager(num_blocks, BS)
    return Scheduler(config, bm), bm


def fake_step(sched: Scheduler, next_token=lambda seq: 7) -> list[Sequence]:
    """One step with a fake model: advance computed tokens, append a token where sampled."""
    batch = sched.schedule()
    if batch is None:
        return []
    assert batch.num_tokens <= sched.max_num_batched_tokens
    for seq, q in zip(batch.seqs, batch.query_lens, strict=True):
        assert q >= 1
        assert len(seq.block_ids) * BS >= seq.num_computed_tokens + q
    sampled = [s for s, q in zip(batch.seqs, batch.query_lens, strict=True)
               if s.num_computed_tokens + q == len(s)]  # fmt: skip
    sched.complete(batch)
    for seq in sampled:
        seq.token_ids.append(next_token(seq))
    return batch.seqs


def run_to_completion(sched: Scheduler, seqs: list[Sequence], max_out: int, **kw) -> None:
    for s in seqs:
        sched.add(s)
    for _ in range(1000):
        fake_step(sched, **kw)
        for s in list(sched.running):
            if s.num_output_tokens >= max_out:
                sched.finish(s, "length")
        if not sched.has_unfinished():
            return
    raise AssertionError("scheduler did not finish")


def test_all_blocks_free_after_finish_and_abort():
    sched, bm = make_scheduler(num_blocks=64)
    seqs = [Sequence(f"r{i}", list(range(i * 3 + 1)), SamplingParams()) for i in range(6)]
    for s in seqs:
        sched.add(s)
    fake_step(sched)
    sched.finish(seqs[2], "abort")  # running
    sched.finish(seqs[5], "abort")  # maybe still waiting
    run_to_completion(sched, [], max_out=5)
    assert bm.num_free_blocks == 64
    assert all(rc == 0 for rc in bm.ref_counts)


def test_chunked_prefill_respects_budgets_and_puts_decodes_first():
    sched, _ = make_scheduler(num_blocks=64, max_tokens=8, max_seqs=3)
    short = Sequence("short", [1, 2], SamplingParams())
    long = Sequence("long", list(range(30)), SamplingParams())
    sched.add(short)
    fake_step(sched)  # short prefilled, now decoding
    sched.add(long)
    sched.add(Sequence("a", [1], SamplingParams()))
    sched.add(Sequence("b", [1], SamplingParams()))
    batch = sched.schedule()
    assert batch.num_tokens <= 8
    assert batch.seqs[0] is short and batch.query_lens[0] == 1
    assert batch.seqs[1] is long and batch.query_lens[1] == 7  # chunked
    assert len(sched.running) <= 3


def test_prefix_cache_hits_shared_full_blocks():
    sched, bm = make_scheduler(num_blocks=64)
    prefix = list(range(100, 112))  # three full blocks
    first = Sequence("a", prefix + [1, 2], SamplingParams())
    run_to_completion(sched, [first], max_out=1)
    second = Sequence("b", prefix + [3], SamplingParams())
    sched.add(second)
    sched.schedule()
    assert second.num_cached_tokens == 12
    assert bm.prefix_hits == 12
    assert bm.prefix_queries == 14 + 13  # every admitted prompt token, cached or not
    # The last token is always computed, even when the whole prompt is cached.
    third = Sequence("c", prefix, SamplingParams())
    sched.add(third)
    batch = sched.schedule()
    assert third.num_cached_tokens == 8
    assert batch.query_lens[batch.seqs.index(third)] == 4
    assert bm.prefix_hits == 12 + 8


def test_prefix_cache_evicts_least_recently_freed():
    sched, bm = make_scheduler(num_blocks=4)
    a = Sequence("a", list(range(8)) + [99], SamplingParams())
    run_to_completion(sched, [a], max_out=1)
    assert bm.num_free_blocks == 4  # freed but still cached
    b = Sequence("b", list(range(50, 62)) + [99], SamplingParams())  # needs all 4 blocks
    run_to_completion(sched, [b], max_out=1)
    c = Sequence("c", list(range(8)) + [5], SamplingParams())
    sched.add(c)
    sched.schedule()
    assert c.num_cached_tokens == 0  # a's blocks were reused by b


def test_preemption_recomputes_and_matches_unpreempted_tokens():
    def token_of(seq):  # depends on the whole context, like a real model
        return (sum(seq.token_ids) * 31 + len(seq)) % 97

    def run(num_blocks):
        sched, bm = make_scheduler(num_blocks=num_blocks, max_tokens=16, max_seqs=4)
        rng = random.Random(0)
        seqs = [
            Sequence(
                f"r{i}", [rng.randrange(97) for _ in range(rng.randint(3, 12))], SamplingParams()
            )
            for i in range(4)
        ]
        run_to_completion(sched, seqs, max_out=12, next_token=token_of)
        assert bm.num_free_blocks == num_blocks
        return [s.output_token_ids[:12] for s in seqs], sched.num_preemptions

    roomy, none = run(num_blocks=64)
    tight, preemptions = run(num_blocks=8)
    assert none == 0 and preemptions > 0
    assert tight == roomy


def test_waiting_sequence_status_and_abort():
    sched, bm = make_scheduler(num_blocks=2, max_tokens=4, max_seqs=1)
    a = Sequence("a", [1, 2, 3], SamplingParams())
    b = Sequence("b", [4, 5, 6], SamplingParams())
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert a.status == SequenceStatus.RUNNING and b.status == SequenceStatus.WAITING
    sched.finish(b, "abort")
    sched.finish(a, "stop")
    assert bm.num_free_blocks == 2 and not sched.has_unfinished()
    assert (a.status, a.finish_reason) == (SequenceStatus.FINISHED, "stop")
    assert (b.status, b.finish_reason) == (SequenceStatus.FINISHED, "abort")


@pytest.mark.parametrize("num_blocks", [3, 5])
def test_random_workload_never_leaks_blocks(num_blocks):
    sched, bm = make_scheduler(num_blocks=num_blocks, max_tokens=6, max_seqs=3)
    rng = random.Random(num_blocks)
    seqs = [
        Sequence(f"r{i}", [rng.randrange(5) for _ in range(rng.randint(1, 7))], SamplingParams())
        for i in range(10)
    ]
    run_to_completion(sched, seqs, max_out=3)
    assert bm.num_free_blocks == num_blocks
    assert not bm.block_of_hash or all(bm.ref_counts[b] == 0 for b in bm.block_of_hash.values())


# ---- block manager, driven directly ----------------------------------------------------
def compute(bm: BlockManager, seq: Sequence, upto: int | None = None) -> Sequence:
    """What a step does to seq's blocks: admit it (if new), allocate for its tokens up to
    `upto` (all by default), count them computed and register the blocks they filled."""
    if not seq.block_ids:
        bm.allocate_cached_prefix(seq)
    upto = len(seq) if upto is None else upto
    bm.allocate(seq, upto - seq.num_computed_tokens)
    seq.num_computed_tokens = upto
    bm.commit(seq)
    return seq


def cached(bm: BlockManager, tokens: list[int], **kw) -> int:
    """Prompt tokens the prefix cache serves to a new request of these tokens."""
    seq = Sequence("probe", tokens, SamplingParams(), **kw)
    bm.allocate_cached_prefix(seq)
    return seq.num_cached_tokens


def test_a_new_pool_is_all_free_with_nothing_counted():
    bm = BlockManager(6, BS)
    assert (bm.num_blocks, bm.num_free_blocks, bm.prefix_queries, bm.prefix_hits) == (6, 6, 0, 0)


def test_block_hashes_chain_each_full_block_to_the_one_before():
    bm = BlockManager(8, BS)
    seq = compute(bm, Sequence("a", list(range(6)), SamplingParams()))
    seq.token_ids += [6, 7, 8]
    compute(bm, seq)
    first = block_hash(None, (0, 1, 2, 3))
    assert seq.block_hashes == [first, block_hash(first, (4, 5, 6, 7))]


def test_without_prefix_caching_nothing_is_hashed_or_shared():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = compute(bm, Sequence("a", list(range(9)), SamplingParams()))
    assert a.block_hashes == [] and bm.block_of_hash == {}
    bm.free(a)
    b = Sequence("b", list(range(9)), SamplingParams())
    bm.allocate_cached_prefix(b)
    assert (b.block_ids, b.num_computed_tokens, b.block_hashes) == ([], 0, [])


def test_equal_blocks_after_different_prefixes_are_not_shared():
    bm = BlockManager(8, BS)
    a = compute(bm, Sequence("a", [1, 1, 1, 1, 5, 6, 7, 8], SamplingParams()))
    b = compute(bm, Sequence("b", [2, 2, 2, 2, 5, 6, 7, 8], SamplingParams()))
    b_blocks = list(b.block_ids)
    bm.free(a)
    bm.free(b)
    c = Sequence("c", [2, 2, 2, 2, 5, 6, 7, 8, 9], SamplingParams())
    bm.allocate_cached_prefix(c)
    assert c.block_ids == b_blocks  # b's second block, not a's with the same tokens


def test_a_partial_prefix_hit_counts_the_hit_blocks_computed():
    bm = BlockManager(8, BS)
    a = compute(bm, Sequence("a", list(range(8)), SamplingParams()))
    first = a.block_ids[0]
    bm.free(a)
    b = Sequence("b", [0, 1, 2, 3, 50, 51, 52, 53, 9], SamplingParams())
    bm.allocate_cached_prefix(b)
    assert b.block_ids == [first]
    assert b.num_computed_tokens == b.num_cached_tokens == 4


def test_prompt_logprobs_bypass_the_prefix_cache():
    bm = BlockManager(8, BS)
    bm.free(compute(bm, Sequence("a", list(range(9)), SamplingParams())))
    assert cached(bm, list(range(9))) == 8
    b = Sequence("b", list(range(9)), SamplingParams(prompt_logprobs=1))
    bm.allocate_cached_prefix(b)
    assert b.block_ids == [] and b.num_computed_tokens == 0  # every position is scored


def test_admitting_a_request_that_holds_blocks_is_refused():
    bm = BlockManager(8, BS)
    seq = Sequence("a", list(range(5)), SamplingParams())
    bm.allocate(seq, 5)  # blocks, none computed yet
    with pytest.raises(AssertionError):
        bm.allocate_cached_prefix(seq)


def test_the_prefix_cache_is_per_lora_adapter():
    bm = BlockManager(16, BS)
    prompt = list(range(8))
    bm.free(compute(bm, Sequence("base", prompt, SamplingParams())))
    assert cached(bm, prompt + [9], lora_name="a") == 0  # the base model's KV differs
    bm.free(compute(bm, Sequence("a", prompt, SamplingParams(), lora_name="a")))
    assert cached(bm, prompt + [9], lora_name="a") == 8
    assert cached(bm, prompt + [9], lora_name="b") == 0
    assert cached(bm, prompt + [9]) == 8


def test_allocation_evicts_the_least_recently_freed_cached_block():
    bm = BlockManager(2, BS)
    bm.free(compute(bm, Sequence("a", [1, 1, 1, 1], SamplingParams())))
    bm.free(compute(bm, Sequence("b", [2, 2, 2, 2], SamplingParams())))
    bm.allocate(Sequence("c", [3], SamplingParams()), 1)
    assert cached(bm, [2, 2, 2, 2, 0]) == 4
    assert cached(bm, [1, 1, 1, 1, 0]) == 0


def test_freed_blocks_without_a_hash_are_reused_before_cached_ones():
    bm = BlockManager(3, BS)
    bm.free(compute(bm, Sequence("b", [2, 2, 2, 2], SamplingParams())))
    bm.free(compute(bm, Sequence("a", [1, 1, 1, 1, 9], SamplingParams())))  # a partial tail
    bm.allocate(Sequence("c", [3], SamplingParams()), 1)  # takes a's tail block
    assert cached(bm, [2, 2, 2, 2, 0]) == 4
    assert cached(bm, [1, 1, 1, 1, 0]) == 4


def test_equal_prompts_computed_together_register_one_block_and_evict_cleanly():
    bm = BlockManager(4, BS)
    a = Sequence("a", list(range(4)), SamplingParams())
    b = Sequence("b", list(range(4)), SamplingParams())
    for seq in (a, b):  # both admitted before either is computed: neither hits the cache
        bm.allocate_cached_prefix(seq)
        bm.allocate(seq, 4)
    for seq in (a, b):
        seq.num_computed_tokens = 4
        bm.commit(seq)
    assert list(bm.block_of_hash.values()) == a.block_ids
    bm.free(a)
    bm.free(b)
    bm.allocate(Sequence("c", [], SamplingParams()), 16)  # evicts every block
    assert bm.block_of_hash == {} and bm.hash_of_block == [None] * 4


def test_a_preempted_prompt_logprobs_request_registers_its_blocks_on_recompute():
    bm = BlockManager(2, BS)
    seq = compute(bm, Sequence("p", list(range(8)), SamplingParams(prompt_logprobs=1)), upto=4)
    bm.free(seq)  # preempted after its first chunk
    seq.reset_for_recompute()
    compute(bm, seq)  # its first block's cached copy is evicted to make room
    bm.free(seq)
    assert cached(bm, list(range(8)) + [9]) == 8


def make_pipelined_scheduler(num_blocks: int, stages: int, max_seqs: int = 8):
    config = EngineConfig(
        device="cpu",
        block_size=BS,
        max_num_batched_tokens=64,
        max_num_seqs=max_seqs,
        pipeline_parallel_size=stages,
    )
    bm = BlockManager(num_blocks, BS)
    return Scheduler(config, bm), bm


def test_microbatches_split_the_requests_and_never_share_one():
    sched, _ = make_pipelined_scheduler(num_blocks=64, stages=2)
    seqs = [Sequence(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(6)]
    for s in seqs:
        sched.add(s)
    first, second = sched.schedule(), sched.schedule()
    assert len(first.seqs) == len(second.seqs) == 3
    assert not set(first.seqs) & set(second.seqs)
    assert sched.schedule() is None  # every request is in flight
    sched.complete(first)
    for seq in first.seqs:
        seq.token_ids.append(7)  # what sampling would have appended
    third = sched.schedule()
    assert set(third.seqs) == set(first.seqs)  # only what left flight runs again
    assert all(s.num_computed_tokens == 3 for s in first.seqs)
    assert all(s.num_computed_tokens == 0 for s in second.seqs)


def test_a_request_aborted_in_flight_is_not_advanced():
    sched, bm = make_pipelined_scheduler(num_blocks=64, stages=2)
    a, b = Sequence("a", [1, 2, 3], SamplingParams()), Sequence("b", [4, 5], SamplingParams())
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    sched.finish(batch.seqs[0], "abort")
    sched.complete(batch)
    assert batch.seqs[0].num_computed_tokens == 0 and not sched.in_flight


def test_preemption_spares_requests_in_flight():
    sched, bm = make_pipelined_scheduler(num_blocks=4, stages=2, max_seqs=2)
    a = Sequence("a", list(range(7)), SamplingParams())  # 2 blocks
    b = Sequence("b", list(range(7)), SamplingParams())  # 2 blocks
    sched.add(a)
    sched.add(b)
    batch_a, batch_b = sched.schedule(), sched.schedule()
    assert batch_a.seqs == [a] and batch_b.seqs == [b] and bm.num_free_blocks == 0
    sched.complete(batch_a)
    a.token_ids.extend([9] * 5)  # a needs a third block while b is in flight
    assert sched.schedule() is None  # a preempts itself, never b
    assert b in sched.in_flight and b.block_ids and a.status is SequenceStatus.WAITING
    assert sched.num_preemptions == 1


def test_a_step_stops_at_the_token_budget_with_requests_left_over():
    config = dict(max_num_batched_tokens=2, max_num_seqs=8, pipeline_parallel_size=2)
    sched = Scheduler(EngineConfig(device="cpu", block_size=BS, **config), BlockManager(64, BS))
    a, b, c = (Sequence(name, [1], SamplingParams()) for name in "abc")
    for seq in (a, b, c):
        sched.add(seq)
    first = sched.schedule()  # a and b; c goes in the next microbatch
    second = sched.schedule()
    assert (first.seqs, second.seqs) == ([a, b], [c])
    for batch in (first, second):
        sched.complete(batch)
        for seq in batch.seqs:
            seq.token_ids.append(7)
    for name in "de":  # waiting requests raise the microbatch's request cap above the budget
        sched.add(Sequence(name, [1], SamplingParams()))
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.query_lens == [1, 1]


def test_the_last_token_of_the_budget_admits_a_waiting_request():
    sched, _ = make_scheduler(num_blocks=64, max_tokens=3)
    a, b = Sequence("a", [1], SamplingParams()), Sequence("b", [2], SamplingParams())
    sched.add(a)
    sched.add(b)
    fake_step(sched)
    c, d = Sequence("c", [1, 2, 3, 4, 5], SamplingParams()), Sequence("d", [6], SamplingParams())
    sched.add(c)
    sched.add(d)
    batch = sched.schedule()
    assert batch.seqs == [a, b, c] and batch.query_lens == [1, 1, 1]
    assert list(sched.waiting) == [d]


@pytest.mark.parametrize("speculative", [False, True])
def test_preempting_a_request_scheduled_earlier_in_the_step_gives_its_tokens_back(speculative):
    """With pipelining, a request admitted while an older one's prefill chunk is in flight
    decodes first in a later step (verifying drafts too, when speculating); the older one's
    next chunk then preempts it. Its tokens (and drafts) leave the batch and go back to the
    budget, which readmits it for a prefill chunk of the same size."""
    spec = {"speculative_method": "ngram", "num_speculative_tokens": 2} if speculative else {}
    config = EngineConfig(
        device="cpu",
        block_size=BS,
        max_num_batched_tokens=8,
        max_num_seqs=8,
        max_model_len=64,
        pipeline_parallel_size=2,
        **spec,
    )
    sched = Scheduler(config, BlockManager(5, BS))
    s = Sequence("s", list(range(16)), SamplingParams())
    # v skips the prefix cache, so its readmission needs just one block
    v = Sequence("v", [1, 2, 1, 2, 1], SamplingParams(prompt_logprobs=1))
    sched.add(s)
    first = sched.schedule()  # s's first chunk (8 tokens, 2 blocks)
    sched.add(v)
    second = sched.schedule()  # v, while s is in flight (2 blocks)
    assert (first.seqs, first.query_lens, second.seqs) == ([s], [8], [v])
    sched.complete(first)
    sched.complete(second)
    v.token_ids.append(2)  # "1 2" repeats: a proposal of 1 2
    sched.add(Sequence("w", [1], SamplingParams()))  # raises the request cap to 2
    # v decodes (1 token, or 3 with its drafts); s's chunk then needs two blocks, one is
    # free: v is preempted and readmitted with the budget s leaves
    batch = sched.schedule()
    assert batch.seqs == [s, v] and batch.drafts == [[], []]
    assert batch.query_lens == ([5, 3] if speculative else [7, 1])
    assert v.num_computed_tokens == 0 and sched.num_preemptions == 1


def test_a_request_preempted_before_its_turn_gives_back_no_budget():
    sched, _ = make_scheduler(num_blocks=4, max_tokens=8, max_seqs=2)
    a = Sequence("a", [1, 2, 3, 4], SamplingParams())
    b = Sequence("b", list(range(10, 22)), SamplingParams(prompt_logprobs=1))
    sched.add(a)
    sched.add(b)
    fake_step(sched)  # a's prompt, b's first 4 tokens: 2 blocks
    batch = sched.schedule()  # a's decode takes a block, so b's next chunk preempts b itself
    assert sched.num_preemptions == 1
    assert batch.seqs == [a, b] and batch.query_lens == [1, 7]  # b readmitted, 7 tokens


def test_every_preemption_is_counted():
    sched, _ = make_scheduler(num_blocks=3, max_tokens=16)
    a, b, c = (Sequence(name, [i] * 4, SamplingParams()) for i, name in enumerate("abc"))
    for seq in (a, b, c):
        sched.add(seq)
    fake_step(sched)  # one full block each; each needs a second one for its next token
    batch = sched.schedule()  # a takes c's block; b finds none and preempts itself
    assert batch.seqs == [a] and list(sched.waiting) == [b, c]
    assert sched.num_preemptions == 2


def test_async_scheduling_schedules_a_decode_of_the_token_in_flight():
    sched, _ = make_scheduler(num_blocks=64, async_scheduling=True, max_model_len=64)
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=3))
    sched.add(seq)
    first = sched.schedule()
    second = sched.schedule()  # while first is in flight: the decode of the token it samples
    assert second.seqs == [seq] and second.query_lens == [1] and second.sampled == [True]
    assert seq.num_in_flight_tokens == 4 and seq.num_pending_tokens == 2
    assert sched.schedule() is None  # one batch ahead at most
    sched.complete(first)
    seq.token_ids.append(7)
    assert seq.num_computed_tokens == 3 and seq.num_uncomputed_tokens == 1


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "max_model_len"), [([1, 2, 3], 1, 64), ([1, 2, 3], 8, 4)]
)
def test_async_scheduling_waits_when_the_token_in_flight_may_be_the_last(
    prompt, max_tokens, max_model_len
):
    sched, _ = make_scheduler(num_blocks=64, async_scheduling=True, max_model_len=max_model_len)
    sched.add(Sequence("a", prompt, SamplingParams(max_tokens=max_tokens)))
    assert sched.schedule() is not None
    assert sched.schedule() is None  # that token ends it by max_tokens or max_model_len


def test_async_scheduling_waits_for_a_block_held_by_requests_in_flight():
    sched, _ = make_scheduler(num_blocks=1, async_scheduling=True, max_model_len=64)
    seq = Sequence("a", [1, 2, 3, 4], SamplingParams())
    sched.add(seq)
    first = sched.schedule()
    assert sched.schedule() is None  # its next token needs a second block: no victim in flight
    assert seq.status is SequenceStatus.RUNNING and sched.num_preemptions == 0
    sched.complete(first)


def test_max_loras_bounds_the_adapters_of_a_step_and_adapters_keep_their_place():
    sched, _ = make_scheduler(num_blocks=64, max_loras=1)
    a1, a2, b, a3 = (
        Sequence(f"r{i}", [1, 2], SamplingParams(), lora_name=name) for i, name in enumerate("aaba")
    )
    base = Sequence("base", [1, 2], SamplingParams())
    for seq in (a1, a2, b, base, a3):
        sched.add(seq)
    batch = sched.schedule()
    # b waits for a's slot; base goes ahead; a3 keeps its place behind b
    assert batch.seqs == [a1, a2, base] and list(sched.waiting) == [b, a3]
    sched.complete(batch)
    for seq in batch.seqs:
        seq.token_ids.append(7)
    second = sched.schedule()
    assert second.seqs == [a1, a2, base]  # a's requests decode together
    sched.complete(second)
    base.token_ids.append(7)
    sched.finish(a1, "stop")
    sched.finish(a2, "stop")
    assert sched.schedule().seqs == [base, b] and list(sched.waiting) == [a3]


# ---- speculative decoding ---------------------------------------------------------------
def make_spec_scheduler(num_blocks: int, k: int = 3, max_tokens: int = 32, **kw):
    config = EngineConfig(
        device="cpu",
        block_size=BS,
        max_num_batched_tokens=max_tokens,
        max_model_len=kw.pop("max_model_len", 64),
        speculative_method="ngram",
        num_speculative_tokens=k,
        **kw,
    )
    bm = BlockManager(num_blocks, BS)
    return Scheduler(config, bm), bm


def decoding(sched: Scheduler, *prompts: list[int]) -> list[Sequence]:
    """Running requests r0, r1, ... whose prompts are computed in one step and whose first
    output token (a copy of the prompt's last) is appended."""
    seqs = [Sequence(f"r{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
    for seq in seqs:
        sched.add(seq)
    batch = sched.schedule()
    assert batch.seqs == seqs and batch.query_lens == [len(p) for p in prompts]
    sched.complete(batch)
    for seq in seqs:
        seq.token_ids.append(seq.token_ids[-1])
    return seqs


def test_a_repeating_decode_verifies_k_drafts_and_keeps_only_accepted_ones():
    sched, bm = make_spec_scheduler(num_blocks=16)
    (seq,) = decoding(sched, [1, 2, 3, 1, 2, 3, 1])
    seq.token_ids[-1] = 2  # the context ends "3 1 2": the proposer continues 3 1 2
    batch = sched.schedule()
    assert batch.drafts == [[3, 1, 2]] and batch.query_lens == [4]
    assert batch.uniform_query_len == 4
    assert len(seq.block_ids) * BS >= 8 + 3  # blocks for the draft positions too
    seq.token_ids += [3, 9]  # one draft accepted, then a corrected token
    sched.complete(batch, {"r0": 1})
    assert seq.num_computed_tokens == 9  # 7 prompt + the decoded token + one draft
    assert seq.num_uncomputed_tokens == 1
    assert len(bm.block_of_hash) == 2  # full blocks of verified tokens only (8 of 9)


def test_without_any_proposal_the_batch_is_a_plain_decode():
    sched, _ = make_spec_scheduler(num_blocks=16)
    a, b = decoding(sched, [1, 2, 3], [4, 5, 6])
    a.token_ids[-1], b.token_ids[-1] = 40, 41  # last tokens seen nowhere before
    batch = sched.schedule()
    assert batch.drafts == [[], []] and batch.uniform_query_len == 1


def test_requests_without_a_proposal_are_padded_so_the_batch_stays_uniform():
    sched, _ = make_spec_scheduler(num_blocks=16)
    a, b = decoding(sched, [1, 2, 3], [4, 5, 6])
    b.token_ids[-1] = 50  # nothing to match
    batch = sched.schedule()
    assert batch.drafts[batch.seqs.index(a)] == [3, 3, 3]  # "3 3" loops
    assert batch.drafts[batch.seqs.index(b)] == [50, 50, 50]  # padded: its last token
    assert batch.uniform_query_len == 4 and batch.num_tokens == 8


def test_a_batch_speculates_only_when_half_its_decodes_have_a_proposal():
    sched, _ = make_spec_scheduler(num_blocks=32, max_num_seqs=3)
    a, b, c = decoding(sched, [1, 2, 3], [4, 5, 6], [7, 8, 9])
    b.token_ids[-1], c.token_ids[-1] = 50, 51  # one proposal in three: a plain decode
    batch = sched.schedule()
    assert batch.drafts == [[], [], []] and batch.uniform_query_len == 1
    sched.complete(batch)
    for seq in (a, b, c):
        seq.token_ids.append(3 if seq is a else 5)  # now a and b repeat their last token
    assert sum(map(bool, sched.schedule().drafts)) == 3  # two in three: all verify k


def test_drafts_stop_at_max_model_len():
    sched, _ = make_spec_scheduler(num_blocks=32, max_model_len=12)
    (seq,) = decoding(sched, [7] * 9)  # 10 tokens: positions 9, 10 and 11 are left
    batch = sched.schedule()
    assert batch.drafts == [[7, 7]] and len(seq.block_ids) * BS == 12


def test_drafts_stop_at_the_token_budget():
    sched, _ = make_spec_scheduler(num_blocks=32, max_tokens=6, k=4)
    decoding(sched, [1, 1], [2, 2])
    batch = sched.schedule()
    assert batch.query_lens == [5, 1] and batch.drafts == [[1] * 4, []]
    assert batch.uniform_query_len is None


def test_drafts_never_preempt_another_request():
    sched, bm = make_spec_scheduler(num_blocks=4, max_num_seqs=2)
    a, b = decoding(sched, [1] * 7, [2] * 7)  # 8 tokens each: 2 blocks each
    assert bm.num_free_blocks == 0
    batch = sched.schedule()  # drafts would need a third block each
    assert batch.drafts == [[], []] and sched.num_preemptions == 0
    assert a.status is b.status is SequenceStatus.RUNNING


@pytest.mark.parametrize("num_blocks", [64, 10])
def test_speculation_gives_the_same_tokens_and_valid_kv_as_plain_decoding(num_blocks):
    """A fake model whose next token is a function of the whole context verifies the drafts
    as the sampler would. Every step writes its tokens into a fake KV cache; after each
    completion every computed position must hold its token (rejected drafts never count, and
    prefix-cache blocks hold what their hash says), with tight blocks forcing preemption."""

    def token_of(context: list[int]) -> int:
        # runs of one token, broken by a function of the context: drafts are often right
        return (context[-1] + (sum(context) % 5 == 0)) % 6

    def run(spec: bool):
        make = make_spec_scheduler if spec else make_scheduler
        kw = {"max_tokens": 16} | ({"max_num_seqs": 4} if spec else {"max_seqs": 4})
        sched, bm = make(num_blocks=num_blocks, **kw)
        rng = random.Random(1)
        seqs = [
            Sequence(
                f"r{i}", [rng.randrange(6) for _ in range(rng.randint(2, 9))], SamplingParams()
            )
            for i in range(5)
        ]
        for s in seqs:
            sched.add(s)
        kv: dict[tuple[int, int], int] = {}
        accepted_total = 0
        for _ in range(500):
            batch = sched.schedule()
            if batch is None:
                break
            accepted = {}
            for seq, q, drafts in zip(batch.seqs, batch.query_lens, batch.drafts, strict=True):
                start = seq.num_computed_tokens
                inputs = seq.token_ids[start : start + q - len(drafts)] + drafts
                for pos, token in enumerate(inputs, start):
                    kv[seq.block_ids[pos // BS], pos % BS] = token
                if start + q - len(drafts) != len(seq):
                    continue  # a prefill chunk that samples nothing
                new = [token_of(seq.token_ids)]
                while len(new) <= len(drafts) and drafts[len(new) - 1] == new[-1]:
                    new.append(token_of(seq.token_ids + new))
                accepted[seq.request_id] = len(new) - 1
                accepted_total += len(new) - 1
                seq.token_ids += new[: 12 - seq.num_output_tokens]
                if seq.num_output_tokens == 12:  # as the engine does: before completion
                    sched.finish(seq, "length")
            sched.complete(batch, accepted)
            for seq in sched.running:
                for pos in range(seq.num_computed_tokens):
                    assert kv[seq.block_ids[pos // BS], pos % BS] == seq.token_ids[pos]
        assert not sched.has_unfinished() and bm.num_free_blocks == num_blocks
        return [s.output_token_ids for s in seqs], accepted_total, sched.num_preemptions

    plain, _, _ = run(spec=False)
    speculative, accepted, preemptions = run(spec=True)
    assert speculative == plain
    assert accepted > 10
    assert (preemptions > 0) == (num_blocks == 10)


def test_complete_counts_only_the_accepted_drafts_it_is_told_of():
    sched, _ = make_spec_scheduler(num_blocks=16)
    a, b = decoding(sched, [1, 2, 3, 1, 2, 3, 1], [4, 5, 6])
    a.token_ids[-1] = 2  # a drafts 3 1 2
    b.token_ids[-1] = 50  # b has no proposal: its drafts are padding
    batch = sched.schedule()
    assert [bool(d) for d in batch.drafts] == [True, True]
    sched.complete(batch, {"r0": 2})  # no count for r1: none of its drafts stand
    assert (a.num_computed_tokens, b.num_computed_tokens) == (8 + 2, 4)
    plain, _ = make_scheduler(num_blocks=16)
    c = Sequence("c", [1, 2, 3], SamplingParams())
    plain.add(c)
    plain.complete(plain.schedule(), {"c": 2})  # a batch without drafts: counts ignored
    assert c.num_computed_tokens == 3


def test_async_scheduling_resumes_after_a_speculative_step_completes():
    sched, _ = make_spec_scheduler(num_blocks=16, async_scheduling=True)
    (seq,) = decoding(sched, [1, 2, 3, 1, 2, 3, 1])
    seq.token_ids[-1] = 2
    batch = sched.schedule()
    assert batch.drafts == [[3, 1, 2]]
    seq.token_ids.append(40)  # every draft rejected; 40 was never seen: no proposal next
    sched.complete(batch, {"r0": 0})
    plain = sched.schedule()
    assert plain.drafts == [[]]
    assert sched.schedule() is not None  # a plain decode continues behind it in flight


def test_a_finished_request_id_starts_afresh_in_the_proposer():
    sched, _ = make_spec_scheduler(num_blocks=32)
    (old,) = decoding(sched, [1, 2, 3, 1, 2, 3, 1])
    assert sched.schedule().drafts == [[1, 1, 1]]  # the proposer now holds r0's tokens
    sched.finish(old, "stop")
    (new,) = decoding(sched, [5, 6, 7, 5, 6, 7, 5, 6])  # the same request id, r0
    new.token_ids[-1] = 7  # the context ends "5 6 7": the proposer continues 5 6 7
    assert sched.schedule().drafts == [[5, 6, 7]]


def test_a_new_sequence_waits_unfinished_and_keeps_what_its_params_ask_for():
    """A new request: waiting, nothing computed, cached or committed, no finish reason, no
    grammar; EOS among its stop ids unless ignore_eos (or the model has none); room for
    logprobs only when asked, and a prompt-logprob entry per prompt token (the first has none
    to score) only when asked."""
    plain = Sequence("a", [5, 6, 7], SamplingParams(stop_token_ids=[9]), eos_token_id=2)
    assert plain.status is SequenceStatus.WAITING and plain.finish_reason is None
    assert (plain.num_computed_tokens, plain.num_cached_tokens, plain.num_committed_blocks) == (
        0, 0, 0,
    )  # fmt: skip
    assert plain.grammar is None and plain.logprobs is None and plain.prompt_logprobs is None
    assert plain.stop_ids == {9, 2}
    assert Sequence("b", [5], SamplingParams(ignore_eos=True), eos_token_id=2).stop_ids == set()
    assert Sequence("c", [5], SamplingParams()).stop_ids == set()
    asks = Sequence("d", [5, 6, 7], SamplingParams(logprobs=2, prompt_logprobs=1))
    assert asks.logprobs == [] and asks.prompt_logprobs == [None, None, None]
