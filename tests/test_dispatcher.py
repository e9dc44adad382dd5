"""Dispatch of every batch kind in every mode, and the keys to capture."""

import pytest

from ostinato.config import EngineConfig
from ostinato.graphs.dispatcher import Dispatcher
from ostinato.graphs.modes import BatchDescriptor, CudaGraphMode
from ostinato.graphs.plan import CapturePlan

M = CudaGraphMode
NONE, PIECEWISE, FULL = M.NONE, M.PIECEWISE, M.FULL
MAX_SEQS = 32


def dispatcher(mode: CudaGraphMode, **kw) -> Dispatcher:
    config = EngineConfig(device="cuda", max_num_seqs=MAX_SEQS, max_capture_size=128, **kw)
    return Dispatcher(mode, CapturePlan.from_config(config))


def full_decode(r: int) -> BatchDescriptor:
    return BatchDescriptor(r, r, 1)


def full_tokens(t: int) -> BatchDescriptor:
    return BatchDescriptor(t, min(t, MAX_SEQS), None)


PW = BatchDescriptor.piecewise
DECODE_5 = (5, 5, 1)  # 5 requests, one token each
MIXED_5 = (5, 2, None)  # e.g. a 4-token prefill chunk and a decode
BIG_DECODE = (MAX_SEQS + 1, MAX_SEQS + 1, 1)  # more requests than any decode graph
HUGE = (129, 3, None)  # more tokens than any graph

CASES = {
    # mode: [(batch, expected runtime mode, expected key or None for the unpadded one)]
    M.NONE: [(DECODE_5, NONE, None), (MIXED_5, NONE, None)],
    M.PIECEWISE: [(DECODE_5, PIECEWISE, PW(8)), (MIXED_5, PIECEWISE, PW(8)), (HUGE, NONE, None)],
    M.FULL: [
        (DECODE_5, FULL, full_tokens(8)),
        (MIXED_5, FULL, full_tokens(8)),
        (BIG_DECODE, FULL, full_tokens(48)),
        (HUGE, NONE, None),
    ],
    M.FULL_DECODE_ONLY: [
        (DECODE_5, FULL, full_decode(8)),
        (MIXED_5, NONE, None),
        (BIG_DECODE, NONE, None),
    ],
    M.FULL_AND_PIECEWISE: [
        (DECODE_5, FULL, full_decode(8)),
        (MIXED_5, PIECEWISE, PW(8)),
        (BIG_DECODE, PIECEWISE, PW(48)),
        (HUGE, NONE, None),
    ],
}


@pytest.mark.parametrize(
    ("mode", "batch", "runtime", "key"),
    [(mode, *case) for mode, cases in CASES.items() for case in cases],
)
def test_dispatch(mode, batch, runtime, key):
    assert dispatcher(mode).dispatch(*batch) == (runtime, key or BatchDescriptor(*batch))


def test_full_mode_keys_pad_requests_to_the_token_count():
    d = dispatcher(M.FULL)
    assert d.dispatch(100, 3, None) == (FULL, BatchDescriptor(112, MAX_SEQS, None))


def test_uniform_batch_of_another_query_length_is_not_a_decode():
    d = dispatcher(M.FULL_AND_PIECEWISE)
    assert d.dispatch(12, 3, 4) == (PIECEWISE, PW(16))


def spec_dispatcher(mode: CudaGraphMode, k: int = 3) -> Dispatcher:
    return dispatcher(mode, speculative_method="ngram", num_speculative_tokens=k)


def test_verify_batches_of_one_plus_k_tokens_replay_their_own_full_graphs():
    d = spec_dispatcher(M.FULL_AND_PIECEWISE)
    assert d.dispatch(12, 3, 4) == (FULL, BatchDescriptor(16, 4, 4))  # padded to 4 requests
    assert d.dispatch(3, 3, 1) == (FULL, BatchDescriptor(4, 4, 1))  # no drafts: q = 1 graphs
    assert d.dispatch(9, 3, 3) == (PIECEWISE, PW(16))  # some request has fewer drafts
    full = d.descriptors()[FULL]
    assert {k.uniform_query_len for k in full} == {1, 4}
    assert max(k.num_tokens for k in full) == MAX_SEQS * 4
    assert d.capture_sizes()["full_tokens"][-1] == MAX_SEQS * 4


def test_without_drops_one_query_length_only():
    d = spec_dispatcher(M.FULL_DECODE_ONLY).without([BatchDescriptor(32, 8, 4)])
    assert d.dispatch(20, 5, 4) == (FULL, BatchDescriptor(64, 16, 4))
    assert d.dispatch(5, 5, 1) == (FULL, BatchDescriptor(8, 8, 1))


def test_piecewise_keys_carry_num_tokens_only():
    keys = dispatcher(M.PIECEWISE).descriptors()[PIECEWISE]
    assert all(k.num_reqs is None and k.uniform_query_len is None for k in keys)
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("mode", list(M))
def test_every_dispatched_key_is_captured(mode, k):
    d = spec_dispatcher(mode, k) if k else dispatcher(mode)
    captured = {(m, k) for m, keys in d.descriptors().items() for k in keys}
    for n in range(1, 140):
        for r, q in [(n, 1), (max(1, n // 3), None), (max(1, n // 4), 4)]:
            if r > MAX_SEQS:
                continue  # the scheduler never builds such a batch
            num_tokens = r * q if q else n
            runtime, key = d.dispatch(num_tokens, r, q)
            assert (runtime, key) in captured or runtime is NONE
            if runtime is NONE:
                assert key == BatchDescriptor(num_tokens, r, q)
            else:
                assert key.num_tokens >= num_tokens
                assert key.num_reqs is None or key.num_reqs >= r


@pytest.mark.parametrize(
    ("mode", "full", "piecewise"),
    [(M.NONE, 0, 0), (M.PIECEWISE, 0, 12), (M.FULL, 12, 0), (M.FULL_DECODE_ONLY, 6, 0)]
    + [(M.FULL_AND_PIECEWISE, 6, 12)],
)
def test_descriptors_per_mode(mode, full, piecewise):
    d = dispatcher(mode)  # tokens: 1, 2, 4, 8, 16..128 step 16; decode: 1, 2, 4, 8, 16, 32
    keys = d.descriptors()
    assert (len(keys[FULL]), len(keys[PIECEWISE])) == (full, piecewise)
    sizes = d.capture_sizes()
    assert (len(sizes["full"]), len(sizes["piecewise"])) == (full, piecewise)


def test_without_drops_keys_and_pads_past_them():
    d = dispatcher(M.FULL_AND_PIECEWISE)
    smaller = d.without([full_decode(8), PW(128)])
    assert smaller.dispatch(*DECODE_5) == (FULL, full_decode(16))
    assert smaller.dispatch(120, 4, None) == (NONE, BatchDescriptor(120, 4, None))
    assert full_decode(8) not in smaller.descriptors()[FULL]
    assert d.dispatch(*DECODE_5) == (FULL, full_decode(8))  # the original is unchanged


def test_batch_descriptor_is_a_frozen_key():
    key = BatchDescriptor(8, 8, 1)
    assert {key: 1}[BatchDescriptor(8, 8, 1)] == 1
    with pytest.raises(AttributeError):
        key.num_tokens = 9


@pytest.mark.parametrize("mode", [M.FULL_AND_PIECEWISE, M.FULL])
def test_every_key_carries_the_padded_adapter_count(mode):
    """lora_counts (0, 1, 2, 4): 3 active adapters use the keys of 4, in every kind of key;
    an eager batch keeps the real count; every count has its own keys to capture."""
    d = dispatcher(mode, enable_lora=True, max_loras=4)
    token_mode = mode.mixed_mode
    decode = BatchDescriptor(8, 8, 1 if mode.separate_decode else None, 4)
    assert d.dispatch(5, 5, 1, 3) == (FULL, decode)
    expected = PW(8, 4) if token_mode is PIECEWISE else BatchDescriptor(8, 8, None, 4)
    assert d.dispatch(5, 2, None, 3) == (token_mode, expected)
    assert d.dispatch(1000, 2, None, 3) == (NONE, BatchDescriptor(1000, 2, None, 3))
    keys = d.descriptors()
    for kind in {FULL, token_mode}:
        assert {k.num_active_loras for k in keys[kind]} == {0, 1, 2, 4}
