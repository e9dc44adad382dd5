"""The fused MoE kernel (Triton under the interpreter) and its torch twin against float64 math
written here: each token's top-k experts, weighted and summed; choices to -1 add nothing."""

import pytest
import torch

from ostinato.kernels.moe import align, align_torch, fused_moe, fused_moe_torch


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
    return x, w13, w2, ids, weights


@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter, padded",
    [(1, 4, 2, 64, 32, 0), (5, 8, 2, 48, 40, 2), (40, 6, 3, 32, 24, 3), (3, 16, 4, 64, 16, 0)],
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
        sorted_ids, block_experts = align_torch(ids, 5, 4, 3 + 5)
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
    # bound on blocks from T * K alone: ceil(10 / 4) + min(5, 10)
    assert block_experts.shape == (3 + 5,)
    assert block_experts.tolist()[:3] == [0, 2, 3]


def test_the_one_program_align_equals_the_torch_one(monkeypatch):
    g = torch.Generator().manual_seed(1)
    for tokens, experts, top_k in ((1, 128, 8), (32, 128, 8), (7, 8, 2), (40, 60, 4)):
        ids = torch.rand(tokens, experts, generator=g).topk(top_k, -1).indices.to(torch.int32)
        ids[-1, :] = -1
        blocks = -(-ids.numel() // 16) + min(experts, ids.numel())
        want = align_torch(ids, experts, 16, blocks)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        got = align(ids, experts)
        monkeypatch.delenv("TRITON_INTERPRET")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
