"""The fused MoE kernel (Triton under the interpreter) and its torch twin against float64 math
written here: each token's top-k experts, weighted and summed; choices to -1 add nothing. The
float inputs lie among NaNs (helpers.nan_fenced; x with a gap after each row), so a read outside
a tensor turns the output NaN."""

import pytest
import torch
from helpers import nan_fenced

from ostinato.kernels import moe
from ostinato.kernels.dispatch import SPLIT_COUNTS
from ostinato.kernels.moe import (
    MoeConfig,
    align,
    align_torch,
    fused_moe,
    fused_moe_torch,
    moe_config,
    num_blocks,
)


def reference(x, w13, w2, ids, weights):
    """float64, one (token, choice) at a time."""
    x, w13, w2, weights = (t.double() for t in (x, w13, w2, weights))
    inter = w2.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            h = gate / (1 + torch.exp(-gate)) * up
            out[t] += weights[t, k] * (w2[e] @ h)
    return out


def problem(tokens, experts, top_k, hidden, inter, seed=0, padded=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    scores = torch.rand(tokens, experts, generator=g)
    weights, ids = scores.topk(top_k, dim=-1)
    ids = ids.to(torch.int32)
    ids[tokens - padded :] = -1  # padded tokens route nowhere
    return fenced(x, w13, w2, ids, weights)


def fenced(x, w13, w2, ids, weights):
    """The float inputs among NaNs, x's rows with a gap between them."""
    x = nan_fenced(x, x.shape[1] + 3)
    return x, nan_fenced(w13), nan_fenced(w2), ids, nan_fenced(weights)


@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter, padded",
    [
        (1, 4, 2, 64, 32, 0),
        (5, 8, 2, 48, 40, 2),
        (40, 6, 3, 32, 24, 3),
        (3, 16, 4, 64, 16, 0),
        (40, 2, 2, 1024, 64, 1),  # tl.dot, gate|up's K split (two experts fill few programs)
    ],
)
@pytest.mark.parametrize("kernel", ["triton", "torch"])
def test_fused_moe_equals_float64_math(monkeypatch, kernel, tokens, experts, top_k, hidden,
                                       inter, padded):  # fmt: skip
    x, w13, w2, ids, weights = problem(tokens, experts, top_k, hidden, inter, padded=padded)
    if kernel == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        got = fused_moe(x, w13, w2, ids, weights)
    else:
        got = fused_moe_torch(x, w13, w2, ids, weights)
    want = reference(x, w13, w2, ids, weights)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    if padded:
        assert got[tokens - padded :].abs().max() == 0


@pytest.mark.parametrize("kernel", ["triton", "torch"])
def test_align_puts_each_pair_in_a_block_of_its_expert_and_padding_nowhere(monkeypatch, kernel):
    ids = torch.tensor([[3, 0], [3, -1], [0, 3], [-1, -1], [2, 3]], dtype=torch.int32)
    if kernel == "triton":  # one program sorts a decode batch's pairs
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        sorted_ids, block_experts = align(ids, num_experts=5, block_m=4)
    else:
        sorted_ids, block_experts = align_torch(ids, 5, 4, 6)
    pairs = ids.numel()
    flat = ids.flatten()
    seen = []
    for b, e in enumerate(block_experts.tolist()):
        block = sorted_ids[b * 4 : (b + 1) * 4].tolist()
        real = [p for p in block if p < pairs]
        if e < 0:
            assert real == []
            continue
        assert all(flat[p] == e for p in real) and real
        seen += real
    assert sorted(seen) == [p for p in range(pairs) if flat[p] >= 0]
    # bound on blocks from T * K alone: (10 pairs + 5 experts x 3 padding slots) // 4
    assert block_experts.shape == (6,)
    assert block_experts.tolist()[:3] == [0, 2, 3]


@pytest.mark.parametrize("block_m", [1, 16])
def test_the_one_program_align_equals_the_torch_one(monkeypatch, block_m):
    g = torch.Generator().manual_seed(1)
    for tokens, experts, top_k in ((1, 128, 8), (32, 128, 8), (7, 8, 2), (40, 60, 4)):
        ids = torch.rand(tokens, experts, generator=g).topk(top_k, -1).indices.to(torch.int32)
        ids[-1, :] = -1
        want = align_torch(ids, experts, block_m, num_blocks(ids.numel(), experts, block_m))
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        got = align(ids, experts, block_m)
        monkeypatch.delenv("TRITON_INTERPRET")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def crowded(dtype):
    """5 tokens of top-3 over 6 experts, odd sizes (hidden 37, intermediate 24): every live
    token's first choice is expert 1 (one block of several pairs, or several blocks of one
    expert), expert 5 goes unused, and the last token is padding (its pairs go nowhere, so
    blocks past the last stay unused)."""
    x, w13, w2, ids, weights = problem(5, 6, 3, 37, 24, seed=3)
    ids = torch.tensor(
        [[1, 0, 2], [1, 3, 4], [1, 2, 0], [1, 4, 3], [-1, -1, -1]], dtype=torch.int32
    )
    return fenced(x.to(dtype), w13.to(dtype), w2.to(dtype), ids, weights)


@pytest.mark.parametrize(
    "config",
    [
        MoeConfig(1, 8, 16, 1, 4, 1),  # FMAs, three chunks of K (down: two)
        MoeConfig(1, 16, 16, 3, 4, 1),  # FMAs, K split in three (down: in two)
        MoeConfig(1, 4, 32, 2, 4, 1),  # FMAs, K split in two (down: whole)
        MoeConfig(16, 16, 16, 3, 4, 3),  # tl.dot, K split in three
        MoeConfig(16, 32, 32, 2, 4, 3),  # tl.dot, K split in two (down: whole)
    ],
)  # fmt: skip
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2**-7)])
def test_every_launch_equals_float64_math(monkeypatch, config, dtype, tol):
    """The decode launches of both grouped GEMMs, FMAs and split K, against float64 math; a
    second call gives the same bits (a split leaves its counts at 0)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, w13, w2, ids, weights = crowded(dtype)
    want = reference(x, w13, w2, ids, weights)
    got = fused_moe(x, w13, w2, ids, weights, configs=(config, config))
    assert got.dtype == dtype
    # within the rounding of the dtype (h is stored in it too), relative to the output's size
    size = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * size)
    assert got[-1].abs().max() == 0
    if config.split > 1:
        again = fused_moe(x, w13, w2, ids, weights, configs=(config, config))
        torch.testing.assert_close(again, got, rtol=0, atol=0)


def test_moe_config_chooses_from_shapes_a_launch_both_gemms_share():
    """qwen3-30b-a3b's experts on 132 SMs: FMAs for decode, tl.dot with K split to fill the
    GPU for a few dozen tokens, the old launch for large batches; each valid for the kernel."""
    for pairs in (1, 8, 64, 65, 256, 257, 4096):
        up = moe_config(pairs, 768, 2048, True, 2, 128, 132)
        down = moe_config(pairs, 2048, 768, False, 2, 128, 132)
        assert up.block_m == down.block_m == (1 if pairs <= moe.FMA_PAIRS else 16)
        for config, n, k, rows in ((up, 768, 2048, 2), (down, 2048, 768, 1)):
            span = moe._span(k, config)[0]
            if config.block_m == 1:  # the unrolled span's loads fit
                threads = 32 * config.num_warps
                assert rows * config.block_n * span * 2 <= moe.FMA_THREAD_LOADS * threads
            tiles = num_blocks(pairs, 128, config.block_m) * -(-n // config.block_n)
            assert config.split == 1 or tiles <= SPLIT_COUNTS
            if pairs > moe.SMALL_PAIRS:
                assert config == MoeConfig(16, 64, 64, 1, 4, 3)  # the launch before issue 21
    assert moe_config(256, 64, 1024, True, 2, 2, 4).split > 1  # two experts: 2 programs, 4 SMs


# ---- decode sizes: the down GEMM sums each token's choices; route and align in one program ----

LAUNCHES = [
    MoeConfig(1, 16, 16, 1, 4, 1),  # FMAs, two chunks of K (gate|up: three)
    MoeConfig(1, 16, 16, 2, 4, 1),  # FMAs, K split in two
    MoeConfig(16, 16, 16, 2, 4, 3),  # tl.dot, K split in two
]
# every launch at each top_k, less the slowest to interpret (K split FMAs at top 8)
SUMMING_CASES = [
    (c, k) for k in (1, 2, 8) for c in LAUNCHES if (c.split, c.block_m, k) != (2, 1, 8)
]


def summing_problem(top_k, dtype):
    """6 tokens of top_k over 10 experts, odd sizes (hidden 37, intermediate 23): every routed
    token's first choice is expert 4 (one block of several pairs, or several blocks of one
    expert), token 2 routes only its first choice (the rest -1), token 4 is padding."""
    x, w13, w2, _, weights = problem(6, 10, top_k, 37, 23, seed=5)
    g = torch.Generator().manual_seed(6)
    others = [torch.randperm(9, generator=g)[: top_k - 1].add(5).remainder(10) for _ in range(6)]
    ids = torch.stack([torch.cat([torch.tensor([4]), o]) for o in others]).to(torch.int32)
    ids[2, 1:] = -1
    ids[4] = -1
    return fenced(x.to(dtype), w13.to(dtype), w2.to(dtype), ids, weights)


def summed_down(h, w2, ids, weights):
    """float64: out[t] = sum over t's routed choices k of weights[t, k] * w2[e] @ h[t * K + k]."""
    top_k = ids.shape[1]
    out = torch.zeros(ids.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(ids.shape[0]):
        for k in range(top_k):
            if ids[t, k] >= 0:
                row = h[t * top_k + k].double()
                out[t] += float(weights[t, k]) * (w2[ids[t, k]].double() @ row)
    return out


@pytest.mark.parametrize("config, top_k", SUMMING_CASES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2**-7)])
def test_the_down_gemm_sums_each_tokens_choices(monkeypatch, config, top_k, dtype, tol):
    """The down GEMM alone, [T, H] out filled with NaN first: each token's weighted sum over
    its routed choices, float64 math written here; a token routed nowhere gets a row of zeros;
    a second launch the same bits (the counts went back to 0)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _, _, w2, ids, weights = summing_problem(top_k, dtype)
    h = torch.randn(ids.numel(), w2.shape[2], generator=torch.Generator().manual_seed(7))
    h = nan_fenced(h.to(dtype), w2.shape[2] + 3)
    want = summed_down(h, w2, ids, weights)
    sorted_ids, block_experts = align(ids, 10, config.block_m)
    flat = nan_fenced(weights.reshape(-1).float())
    outs = []
    for _ in range(2):
        out = torch.full((6, w2.shape[1]), float("nan"), dtype=dtype)
        moe.moe_gemm(h, w2, out, sorted_ids, block_experts, flat, 1, False, config, sum_ids=ids)
        outs.append(out)
    size = want.abs().max().item()
    torch.testing.assert_close(outs[0].double(), want, rtol=tol, atol=tol * size)
    assert torch.equal(outs[0][4], torch.zeros(w2.shape[1], dtype=dtype))
    assert torch.equal(outs[1], outs[0])


@pytest.mark.parametrize("config, top_k", [case for case in SUMMING_CASES if case[1] > 1])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2**-7)])
def test_the_summing_layer_equals_float64_math_and_the_old_sum(monkeypatch, config, top_k, dtype,
                                                                tol):  # fmt: skip
    """fused_moe at decode sizes (the down GEMM sums) against float64 math and the torch twin,
    and against the zeroed output and sum kernel it replaced (SUM_PAIRS 0): the same up to
    the bf16 rounding of each choice's row, which the old path stored."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, w13, w2, ids, weights = summing_problem(top_k, dtype)
    want = reference(x, w13, w2, ids, weights)
    got = fused_moe(x, w13, w2, ids, weights, configs=(config, config))
    size = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * size)
    torch.testing.assert_close(got, fused_moe_torch(x, w13, w2, ids, weights), rtol=tol,
                               atol=tol * size)  # fmt: skip
    assert got[4].abs().max() == 0
    monkeypatch.setattr(moe, "SUM_PAIRS", 0)
    old = fused_moe(x, w13, w2, ids, weights, configs=(config, config))
    torch.testing.assert_close(got, old, rtol=tol, atol=tol * size)


def routing64(logits, top_k, renormalize, slots):
    """float64: softmax, the top_k largest (the lowest expert first on a tie), renormalised if
    asked; padded tokens' choices -1."""
    p = torch.softmax(logits.double(), -1)
    order = torch.sort(-p, dim=-1, stable=True).indices[:, :top_k]
    weights = p.gather(-1, order)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, order.masked_fill(slots[:, None] < 0, -1).to(torch.int32)


@pytest.mark.parametrize("route_tile", [moe.ROUTE_TILE, 32])  # 32: two tokens a step
@pytest.mark.parametrize("block_m", [1, 16])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_and_align_in_one_program(monkeypatch, dtype, top_k, renormalize, block_m,
                                        route_tile):  # fmt: skip
    """The one-program route + align against float64 routing written here and align_torch:
    7 tokens over 12 experts, a tie (lowest expert first), two padded tokens (slot -1).
    Renormalised, the weights are Mixtral's: the softmax of the top_k logits."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(moe, "ROUTE_TILE", route_tile)
    logits = (torch.randn(7, 12, generator=torch.Generator().manual_seed(8)) * 3).to(dtype)
    logits[1, 3] = logits[1, 7] = logits[1].max() + 1  # a tie for the first choice
    logits = nan_fenced(logits, 13)
    slots = torch.tensor([5, 9, -1, 2, 11, 12, -1])
    weights, ids, (sorted_ids, block_experts) = moe.route_and_align(
        logits, top_k, renormalize, slots, block_m
    )
    want_w, want_ids = routing64(logits, top_k, renormalize, slots)
    assert torch.equal(ids, want_ids)
    assert ids[1, 0] == 3
    live = slots >= 0
    torch.testing.assert_close(weights[live].double(), want_w[live], rtol=1e-6, atol=1e-7)
    if renormalize:
        top = logits.double().topk(top_k, -1).values
        torch.testing.assert_close(weights[live].double(), torch.softmax(top, -1)[live],
                                   rtol=1e-6, atol=1e-7)  # fmt: skip
    blocks = num_blocks(ids.numel(), 12, block_m)
    want_sorted, want_experts = align_torch(want_ids, 12, block_m, blocks)
    assert torch.equal(sorted_ids, want_sorted) and torch.equal(block_experts, want_experts)
    route_w, route_ids = moe.route(logits, top_k, renormalize, slots)  # the per-token kernel
    assert torch.equal(route_ids, ids) and torch.equal(route_w, weights)


@pytest.mark.parametrize("tokens, top_k", [(3, 2), (40, 2)])  # FMAs; tl.dot with K split
def test_routed_moe_equals_float64_math(monkeypatch, tokens, top_k):
    """A layer from its router's logits (route and align in one program, the summing down
    GEMM) against float64 routing and experts written here; padded tokens add nothing."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, w13, w2, _, _ = problem(tokens, 6, top_k, 48, 40, seed=9)
    logits = nan_fenced(torch.randn(tokens, 6, generator=torch.Generator().manual_seed(10)), 7)
    slots = torch.arange(tokens)
    slots[-1] = -1
    got = moe.routed_moe(x, logits, w13, w2, top_k, True, slots)
    weights, ids = routing64(logits, top_k, True, slots)
    want = reference(x, w13, w2, ids, weights)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    assert got[-1].abs().max() == 0
