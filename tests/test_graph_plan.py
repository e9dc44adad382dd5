"""Capture plans: the two ladders, their caps, the override, and padding arithmetic."""

import pytest
import torch

from ostinato.config import EngineConfig
from ostinato.graphs.capture import GraphRunner
from ostinato.graphs.memory import graph_memory_reserve
from ostinato.graphs.modes import BatchDescriptor
from ostinato.graphs.plan import CapturePlan, padded_size
from ostinato.kernels.paged_attention import choose_config

LADDER_TO_512 = [1, 2, 4, 8, *range(16, 257, 16), *range(288, 513, 32)]
SPARSE_TO_8192 = [640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096,
                  5120, 6144, 7168, 8192]  # fmt: skip


def plan(**kw) -> CapturePlan:
    return CapturePlan.from_config(EngineConfig(device="cuda", **kw))


def test_default_ladders():
    """Token graphs reach max_num_batched_tokens: dense to 512, then sparse; FULL decode
    graphs stop at max_num_seqs."""
    p = plan()
    assert list(p.token_sizes) == LADDER_TO_512 + SPARSE_TO_8192
    assert list(p.decode_sizes) == LADDER_TO_512[: LADDER_TO_512.index(256) + 1]
    assert p.decode_query_lens == (1,)


def test_sparse_ladder_follows_max_num_batched_tokens():
    assert plan(max_num_batched_tokens=3000).token_sizes[-4:] == (1792, 2048, 2560, 3000)
    big = plan(max_num_batched_tokens=16384, max_num_seqs=1024)
    assert big.token_sizes[-5:] == (8192, 10240, 12288, 14336, 16384)
    assert big.decode_sizes[-3:] == (768, 896, 1024)  # max_num_seqs above 512: sparse too


def test_sparse_padding_waste_under_a_quarter():
    p = plan()
    for n in range(513, 8193, 7):
        assert (p.pad_tokens(n) - n) / n < 0.25


def test_max_capture_size_caps_token_graphs_only():
    p = plan(max_capture_size=1024)
    assert p.token_sizes[-5:] == (512, 640, 768, 896, 1024)
    assert p.decode_sizes[-1] == 256


def test_lists_are_separate():
    p = plan(max_num_seqs=8, max_capture_size=64)
    assert p.decode_sizes == (1, 2, 4, 8)
    assert p.token_sizes == (1, 2, 4, 8, 16, 32, 48, 64)


@pytest.mark.parametrize("max_tokens", [1, 3, 100, 300, 8192])
def test_token_sizes_never_exceed_max_num_batched_tokens(max_tokens):
    p = plan(max_num_batched_tokens=max_tokens, max_num_seqs=1)
    assert max(p.token_sizes) == max_tokens
    assert max(plan(max_num_batched_tokens=max_tokens, max_capture_size=512).token_sizes) == min(
        512, max_tokens
    )
    assert max(p.decode_sizes) == 1


def test_cap_off_the_ladder_is_included():
    p = plan(max_num_seqs=100, max_capture_size=500)
    assert p.decode_sizes[-3:] == (80, 96, 100)
    assert p.token_sizes[-3:] == (448, 480, 500)


def test_decode_sizes_bounded_by_tokens_per_step():
    p = plan(
        max_num_seqs=64,
        max_num_batched_tokens=64,
        speculative_method="ngram",
        num_speculative_tokens=3,
    )
    assert p.decode_query_lens == (1, 4)  # plain decode steps, and verify steps of 1 + k
    assert p.decode_sizes[-1] == 16  # 16 requests x q=4 = 64 tokens


def test_capture_sizes_override_is_sorted_deduplicated_and_capped():
    p = plan(capture_sizes=[64, 1, 8, 8, 9000], max_num_seqs=32)
    assert p.token_sizes == (1, 8, 64)
    assert p.decode_sizes == (1, 8)


@pytest.mark.parametrize(
    ("n", "expected"),
    [(1, 1), (3, 4), (8, 8), (9, 16), (257, 288), (512, 512), (513, 640), (4097, 5120),
     (8192, 8192), (8193, None)],
)  # fmt: skip
def test_pad_tokens(n, expected):
    assert plan().pad_tokens(n) == expected


def test_padding_is_the_smallest_captured_size_at_least_n():
    p = plan(max_num_seqs=200)
    for n in range(1, 600):
        padded = padded_size(p.token_sizes, n)
        if n > p.token_sizes[-1]:
            assert padded is None
            continue
        assert padded >= n and padded in p.token_sizes
        assert not [s for s in p.token_sizes if n <= s < padded]
        assert p.pad_reqs(n) == (None if n > 200 else min(s for s in p.decode_sizes if s >= n))


def test_graph_memory_reserve_covers_the_largest_graph_and_every_graph():
    """The KV sizing leaves twice a step's activations scaled to the largest graph, plus
    4 MiB per graph and 32 MiB for the pool: with token graphs up to 8192 the whole
    activation counts. FULL prefill graphs count like any other."""
    gib, mib = 2**30, 2**20

    def reserve(**kw) -> tuple[int, int]:
        runner = GraphRunner(EngineConfig(device="cuda", **kw))
        descs = [d for ds in runner.dispatcher.descriptors().values() for d in ds]
        return graph_memory_reserve(descs, gib, 8192), len(descs)

    full, n = reserve()
    # FULL decode graphs to 256 requests, token graphs to 8192, FULL prefill graphs of 29
    # token sizes (64..2048) for 1 and 4 requests
    assert n == 20 + 44 + 29 * 2
    assert full == 2 * gib + n * 4 * mib + 32 * mib
    capped, m = reserve(max_capture_size=512)
    assert m == 20 + 28 + 21 * 2 and capped == 2 * gib // 16 + m * 4 * mib + 32 * mib
    _, without = reserve(full_prefill_max_tokens=0)
    assert without == 20 + 44
    assert graph_memory_reserve([], gib, 8192) == 0
    # a graph past the step budget holds no more than a budget-sized step's activations
    past = graph_memory_reserve([BatchDescriptor(16384, None, None)], gib, 8192)
    assert past == 2 * gib + 4 * mib + 32 * mib


def test_an_override_keeps_a_size_equal_to_the_cap():
    p = plan(capture_sizes=[4, 8, 64], max_num_seqs=8, max_capture_size=64)
    assert p.token_sizes == (4, 8, 64) and p.decode_sizes == (4, 8)
    assert p.max_num_seqs == 8


@pytest.mark.parametrize(
    ("max_loras", "counts"), [(1, (0, 1)), (4, (0, 1, 2, 4)), (5, (0, 1, 2, 4, 5))]
)
def test_lora_counts_are_zero_powers_of_two_and_max_loras(max_loras, counts):
    p = plan(enable_lora=True, max_loras=max_loras)
    assert p.lora_counts == counts
    assert [p.pad_loras(n) for n in range(max_loras + 2)] == [
        min(c for c in counts if c >= n) for n in range(max_loras + 1)
    ] + [None]
    assert plan(max_loras=max_loras).lora_counts == (0,)  # LoRA off: the base graphs only


# ---- FULL prefill sizes ----------------------------------------------------------------------


def test_full_prefill_sizes_are_the_token_ladder_from_64_to_2048():
    p = plan()
    assert p.prefill_token_sizes == tuple(s for s in p.token_sizes if 64 <= s <= 2048)
    assert len(p.prefill_token_sizes) == 29 and p.prefill_reqs == (1, 4)
    assert [p.in_prefill_range(n) for n in (48, 49, 2048, 2049)] == [False, True, True, False]
    assert [p.pad_prefill_reqs(n) for n in (1, 2, 4, 5)] == [1, 4, 4, None]


@pytest.mark.parametrize(("max_num_seqs", "reqs"), [(1, (1,)), (2, (1, 2)), (256, (1, 4))])
def test_full_prefill_request_counts_stop_at_max_num_seqs(max_num_seqs, reqs):
    assert plan(max_num_seqs=max_num_seqs).prefill_reqs == reqs


@pytest.mark.parametrize(
    ("kw", "sizes"),
    [
        (
            {"max_capture_size": 1024},
            (*range(64, 257, 16), *range(288, 513, 32), 640, 768, 896, 1024),
        ),
        ({"max_capture_size": 48}, ()),
        ({"full_prefill_max_tokens": 0}, ()),
        (
            {"full_prefill_min_tokens": 1500, "full_prefill_max_tokens": 4096},
            (1536, 1792, 2048, 2560, 3072, 3584, 4096),
        ),
        ({"capture_sizes": [1, 100, 3000]}, (100,)),
    ],
)
def test_full_prefill_sizes_follow_their_range_and_the_token_cap(kw, sizes):
    p = plan(**kw)
    assert p.prefill_token_sizes == sizes
    assert p.prefill_reqs == ((1, 4) if sizes else ())
    off = p.without_full_prefill()
    assert off.prefill_token_sizes == off.prefill_reqs == ()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"full_prefill_min_tokens": 0}, "at least 1"),
        ({"full_prefill_max_tokens": -1}, "at least 0"),
        ({"full_prefill_min_tokens": 512, "full_prefill_max_tokens": 256}, "below"),
    ],
)
def test_bad_full_prefill_ranges_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(device="cuda", **kw)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "dtype"),
    [(16, 8, 128, torch.bfloat16), (32, 8, 128, torch.bfloat16), (14, 2, 64, torch.bfloat16)]
    + [(32, 8, 128, torch.float32), (8, 1, 256, torch.bfloat16)],
)
def test_full_prefill_keys_launch_attention_as_their_real_steps_do(
    heads, kv_heads, head_dim, dtype
):
    """The attention kernel picks its launch from shapes, num_reqs the padded count: for every
    FULL prefill key of the default plan it must be the large-tile launch that eager attention
    picks for the step's real requests (any count up to the key's), not the short-query one
    mode full's keys of min(tokens, max_num_seqs) requests get."""
    p = plan()
    k_cache = torch.empty(1, 16, kv_heads, head_dim, dtype=dtype)
    table = torch.empty(4, 256, dtype=torch.int32)
    for t in p.prefill_token_sizes:
        q = torch.empty(t, heads, head_dim, dtype=dtype)
        for r in p.prefill_reqs:
            key = choose_config(q, k_cache, table[:r], r)
            assert key.splits == 1, (t, r)
            assert all(choose_config(q, k_cache, table[:n], n) == key for n in range(1, r + 1))
    q = torch.empty(512, heads, head_dim, dtype=dtype)
    assert choose_config(q, k_cache, table, 256) != choose_config(q, k_cache, table[:1], 1)
