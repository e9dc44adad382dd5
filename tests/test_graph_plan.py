"""Capture plans: the two ladders, their caps, the override, and padding arithmetic."""

import pytest

from ostinato.config import EngineConfig
from ostinato.graphs.capture import GraphRunner
from ostinato.graphs.memory import graph_memory_reserve
from ostinato.graphs.plan import CapturePlan, padded_size

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
    activation counts."""
    gib, mib = 2**30, 2**20

    def reserve(**kw) -> tuple[int, int]:
        runner = GraphRunner(EngineConfig(device="cuda", **kw))
        descs = [d for ds in runner.dispatcher.descriptors().values() for d in ds]
        return graph_memory_reserve(descs, gib, 8192), len(descs)

    full, n = reserve()
    assert n == 20 + 44  # FULL decode graphs to 256 requests, token graphs to 8192
    assert full == 2 * gib + n * 4 * mib + 32 * mib
    capped, m = reserve(max_capture_size=512)
    assert m == 20 + 28 and capped == 2 * gib // 16 + m * 4 * mib + 32 * mib
    assert graph_memory_reserve([], gib, 8192) == 0


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
