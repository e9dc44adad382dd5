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
    d = dispatcher(M.FULL)  # 5 requests: more than any FULL prefill key has
    assert d.dispatch(100, 5, None) == (FULL, BatchDescriptor(112, MAX_SEQS, None))


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
    assert {k.uniform_query_len for k in full} == {1, 4, None}  # None: FULL prefill keys
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
    ("mode", "full", "piecewise", "prefill"),
    [(M.NONE, 0, 0, 0), (M.PIECEWISE, 0, 12, 0), (M.FULL, 12, 0, 10)]
    + [(M.FULL_DECODE_ONLY, 6, 0, 0), (M.FULL_AND_PIECEWISE, 6, 12, 10)],
)
def test_descriptors_per_mode(mode, full, piecewise, prefill):
    """tokens: 1, 2, 4, 8, 16..128 step 16; decode: 1, 2, 4, 8, 16, 32; FULL prefill: tokens
    64..128 step 16 for 1 and 4 requests."""
    d = dispatcher(mode)
    keys = d.descriptors()
    assert (len(keys[FULL]), len(keys[PIECEWISE])) == (full + prefill, piecewise)
    sizes = d.capture_sizes()
    assert (len(sizes["full"]), len(sizes["piecewise"])) == (full, piecewise)
    assert len(sizes["full_prefill"]["num_tokens"]) * len(sizes["full_prefill"]["num_reqs"]) == (
        prefill
    )


def test_without_drops_keys_and_pads_past_them():
    d = dispatcher(M.FULL_AND_PIECEWISE)
    smaller = d.without([full_decode(8), PW(128)])
    assert smaller.dispatch(*DECODE_5) == (FULL, full_decode(16))
    assert smaller.dispatch(120, 5, None) == (NONE, BatchDescriptor(120, 5, None))
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


# ---- FULL prefill keys: steps of few requests ----------------------------------------------


def default_dispatcher(mode: CudaGraphMode = M.FULL_AND_PIECEWISE, **kw) -> Dispatcher:
    """The default plan: token graphs to 8192, FULL prefill keys of 64..2048 tokens for 1 and
    4 requests."""
    return Dispatcher(mode, CapturePlan.from_config(EngineConfig(device="cuda", **kw)))


def prefill(t: int, r: int) -> BatchDescriptor:
    return BatchDescriptor(t, r, None)


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        ((500, 1, None), (FULL, prefill(512, 1))),  # one prompt: one whole-step graph
        ((500, 3, None), (FULL, prefill(512, 4))),  # 3 requests share the graphs of 4
        ((500, 4, None), (FULL, prefill(512, 4))),
        ((500, 5, None), (PIECEWISE, PW(512))),  # more requests than any FULL prefill key
        ((2048, 1, None), (FULL, prefill(2048, 1))),
        ((3000, 1, None), (PIECEWISE, PW(3072))),  # above 2048 tokens the GPU sets the time
        ((50, 1, None), (FULL, prefill(64, 1))),  # the ladder pads 50 to 64: in range
        ((48, 1, None), (PIECEWISE, PW(48))),  # below the range
        ((3, 3, 1), (FULL, BatchDescriptor(4, 4, 1))),  # a decode step keeps its decode key
    ],
)
def test_few_request_steps_get_full_prefill_keys(batch, expected):
    assert default_dispatcher().dispatch(*batch) == expected


def test_decode_keys_come_before_full_prefill_keys():
    """A verify step of 2 requests x 32 tokens is in the prefill range, but is a decode."""
    d = default_dispatcher(speculative_method="ngram", num_speculative_tokens=31)
    assert d.dispatch(64, 2, 32) == (FULL, BatchDescriptor(64, 2, 32))
    assert d.dispatch(64, 2, None) == (FULL, prefill(64, 4))


@pytest.mark.parametrize(
    ("mode", "one_prompt", "five_prompts"),
    [
        (M.FULL, (FULL, prefill(512, 1)), (FULL, BatchDescriptor(512, 256, None))),
        (M.PIECEWISE, (PIECEWISE, PW(512)), (PIECEWISE, PW(512))),
        (M.FULL_DECODE_ONLY, (NONE, prefill(500, 1)), (NONE, prefill(500, 5))),
        (M.NONE, (NONE, prefill(500, 1)), (NONE, prefill(500, 5))),
    ],
)
def test_full_prefill_keys_in_modes_that_graph_every_step_with_full_graphs(
    mode, one_prompt, five_prompts
):
    d = default_dispatcher(mode)
    assert d.dispatch(500, 1, None) == one_prompt
    assert d.dispatch(500, 5, None) == five_prompts


def test_max_capture_size_caps_full_prefill_keys():
    d = default_dispatcher(max_capture_size=1024)
    assert d.plan.prefill_token_sizes[-1] == 1024
    assert d.dispatch(1000, 1, None) == (FULL, prefill(1024, 1))
    assert d.dispatch(1500, 1, None) == (NONE, prefill(1500, 1))  # above every graph


def test_full_prefill_keys_turned_off_or_narrowed():
    off = default_dispatcher(full_prefill_max_tokens=0)
    assert off.dispatch(500, 1, None) == (PIECEWISE, PW(512))
    assert all(k.uniform_query_len == 1 for k in off.descriptors()[FULL])
    assert off.capture_sizes()["full_prefill"] == {"num_tokens": [], "num_reqs": []}
    narrow = default_dispatcher(full_prefill_min_tokens=256, full_prefill_max_tokens=1024)
    assert narrow.dispatch(200, 1, None) == (PIECEWISE, PW(208))
    assert narrow.dispatch(300, 1, None) == (FULL, prefill(320, 1))
    assert narrow.dispatch(1100, 1, None) == (PIECEWISE, PW(1280))
    assert narrow.capture_sizes()["full_prefill"]["num_tokens"][::4] == [256, 384, 512, 1024]


def test_dropped_full_prefill_keys_pad_past_them():
    d = default_dispatcher().without([prefill(512, 1), prefill(2048, 1)])
    assert d.dispatch(500, 1, None) == (FULL, prefill(640, 1))
    assert d.dispatch(500, 3, None) == (FULL, prefill(512, 4))  # the other count keeps its own
    assert d.dispatch(2000, 1, None) == (PIECEWISE, PW(2048))  # no larger FULL prefill key
    assert prefill(512, 1) not in d.descriptors()[FULL]


def test_full_prefill_keys_count_in_the_capture_sizes():
    d = default_dispatcher()
    sizes = d.capture_sizes()
    ladder = [*range(64, 257, 16), *range(288, 513, 32), 640, 768, 896, 1024, 1280, 1536]
    assert sizes["full_prefill"] == {"num_tokens": [*ladder, 1792, 2048], "num_reqs": [1, 4]}
    assert sizes["full"][-1] == 256  # FULL decode graphs to max_num_seqs, as before
    assert sizes["full_tokens"][-1] == 2048
    assert len(d.descriptors()[FULL]) == 20 + 29 * 2


def test_mode_full_captures_a_key_that_is_both_prefill_and_token_key_once():
    """With max_num_seqs=4 a token key of mode full has 4 requests, as a FULL prefill key."""
    d = default_dispatcher(M.FULL, max_num_seqs=4)
    keys = d.descriptors()[FULL]
    assert len(keys) == len(set(keys))
    assert d.dispatch(500, 3, None) == (FULL, prefill(512, 4))
    assert d.dispatch(500, 1, None) == (FULL, prefill(512, 1))
    assert d.dispatch(20, 3, None) == (FULL, BatchDescriptor(32, 4, None))  # a token key


def test_which_keys_count_as_full_prefill_replays():
    d = default_dispatcher(M.FULL).without([prefill(640, 1)])
    assert d.is_full_prefill(prefill(512, 1)) and d.is_full_prefill(prefill(2048, 4))
    others = [BatchDescriptor(512, 256, None), BatchDescriptor(4, 4, None), prefill(500, 1)]
    others += [prefill(640, 1), prefill(512, 2), PW(512), BatchDescriptor(512, 1, None, 1)]
    assert not any(d.is_full_prefill(k) for k in others)
    assert not default_dispatcher(M.PIECEWISE).is_full_prefill(prefill(512, 1))
