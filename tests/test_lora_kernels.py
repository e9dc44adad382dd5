"""The batched LoRA kernels under TRITON_INTERPRET=1 against their torch versions and a float64
per-token reference: mixed adapters, tokens with none, ranks below the slot size, a shard the
adapter leaves alone, split K, and padded groups. The float tensors lie among NaNs
(helpers.nan_fenced), so a read outside one turns the output NaN, and a write outside y fails."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import fence_intact, nan_fenced

from ostinato.context import ForwardContext, LoRAMetadata, forward_context
from ostinato.kernels import dispatch
from ostinato.kernels import lora as lora_module
from ostinato.kernels.lora import (
    lora_expand,
    lora_expand_silu,
    lora_expand_torch,
    lora_shrink,
    lora_shrink_torch,
)
from ostinato.layers import linear as linear_module
from ostinato.layers.linear import (
    ColumnParallelLinear,
    Linear,
    normed_projection,
    residual_projection,
)
from ostinato.layers.norm import RMSNorm
from ostinato.lora import layer as lora_layer
from ostinato.lora.layer import LoRALinear
from ostinato.runner.input_buffers import group_by_adapter

TOL = {torch.float32: 1e-4, torch.float16: 1e-2}
# float16 stands for the half types: Triton's interpreter gets bfloat16 tl.dot wrong


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)


def metadata(token_slots: list[int], num_active: int) -> LoRAMetadata:
    tokens, slots, starts, counts = group_by_adapter(np.asarray(token_slots))
    pad = num_active - len(slots)
    as_tensor = lambda a, fill=0: torch.tensor([*a, *[fill] * pad], dtype=torch.int32)
    return LoRAMetadata(
        num_active, torch.tensor(tokens, dtype=torch.int32), as_tensor(slots),
        as_tensor(starts), as_tensor(counts),
    )  # fmt: skip


def adapters(slots, shard_sizes, k, rank_max, ranks, dtype):
    """Slot buffers holding adapter s at rank ranks[s][shard], zero beyond it."""
    shards = len(shard_sizes)
    a = torch.zeros(slots, shards * rank_max, k)
    b = torch.zeros(slots, sum(shard_sizes), rank_max)
    offsets = [0, *np.cumsum(shard_sizes).tolist()]
    for s in range(slots):
        for h in range(shards):
            r = ranks[s][h]
            a[s, h * rank_max : h * rank_max + r] = torch.randn(r, k) / k**0.5
            b[s, offsets[h] : offsets[h + 1], :r] = torch.randn(shard_sizes[h], r)
    rank_tensor = torch.tensor(ranks, dtype=torch.int32)
    return nan_fenced(a.to(dtype)), nan_fenced(b.to(dtype)), rank_tensor, tuple(offsets)


def reference_64(x, y, a, b, token_slots, offsets, rank_max):
    out = y.double().clone()
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for h, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
            a_h = a[slot, h * rank_max : (h + 1) * rank_max].double()
            out[t, lo:hi] += b[slot, lo:hi].double() @ (a_h @ x[t].double())
    return out


@pytest.mark.parametrize("summed", [True, False], ids=["shrink-sums", "expand-sums"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("num_tokens", "shard_sizes", "k"),
    [(5, [64, 32, 32], 256), (40, [48], 80), (3, [96, 96], 64)],  # split K; odd widths; 2 shards
)
def test_shrink_expand_match_torch_and_reference(
    dtype, num_tokens, shard_sizes, k, summed, monkeypatch
):
    """summed: the shrink's last split sums the partials (the default); else expand does."""
    monkeypatch.setattr(lora_module, "SUM_SPLITS", summed)
    rank_max, slots = 16, 3
    ranks = [[8] * len(shard_sizes), [16] * len(shard_sizes), [4] * len(shard_sizes)]
    ranks[0][-1] = 0  # adapter in slot 0 leaves its last shard alone
    a, b, rank_tensor, offsets = adapters(slots, shard_sizes, k, rank_max, ranks, dtype)
    token_slots = torch.randint(-1, slots, (num_tokens,)).tolist()
    token_slots[0], token_slots[-1] = -1, 1
    meta = metadata(token_slots, num_active=4)  # more groups than adapters: padded ones
    x = nan_fenced(torch.randn(num_tokens, k).to(dtype), k + 3)
    y = torch.randn(num_tokens, sum(shard_sizes)).to(dtype)
    expected = reference_64(x, y, a, b, token_slots, offsets, rank_max)

    y_torch = y.clone()
    lora_expand_torch(lora_shrink_torch(x, a, rank_tensor, meta), b, rank_tensor, offsets,
                      y_torch, meta)  # fmt: skip
    partials = lora_shrink(x, a, rank_tensor, meta)
    y_triton = nan_fenced(y, y.shape[1] + 3)
    lora_expand(partials, b, rank_tensor, offsets, y_triton, meta)
    assert fence_intact(y_triton)

    tol = TOL[dtype]
    for got in (y_torch, y_triton):
        torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)
    untouched = [t for t, s in enumerate(token_slots) if s < 0]
    assert torch.equal(y_triton[untouched], y[untouched])
    assert not torch.equal(y_triton, y)
    if num_tokens == 5:  # the decode-sized case splits K
        split = lora_module._splits(x, len(shard_sizes), 16, lora_module._block_k(16, 2), summed)
        assert split > 1 and partials.shape[0] == (1 if summed else split)


@pytest.mark.parametrize("summed", [True, False], ids=["shrink-sums", "expand-sums"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_the_shrink_keeps_the_norm_for_the_expand(dtype, with_residual, summed, monkeypatch):
    """lora_shrink with norm: sums of (x + residual) * weight, and in a last column the mean
    of (x + residual)^2 (over split K, summed where the shrink sums its splits); then the
    expand with the norm's eps gives the adapter term of rms_norm(x + residual), against the
    torch versions and float64 math. 5 tokens over 3 adapters, one of none, whose row the
    expand leaves alone; an adapter that leaves shard 0 alone (its programs still run, for the
    mean squares)."""
    monkeypatch.setattr(lora_module, "SUM_SPLITS", summed)
    k, rank_max = 300, 16
    slot_ranks = [[8, 4], [16, 16], [0, 4]]
    a, b, ranks, offsets = adapters(3, [64, 32], k, rank_max, slot_ranks, dtype)
    token_slots = [1, -1, 0, 2, 2]
    meta = metadata(token_slots, num_active=4)
    x = nan_fenced(torch.randn(5, k).to(dtype), k + 3)
    residual = nan_fenced(torch.randn(5, k).to(dtype), k + 1) if with_residual else None
    norm_w = nan_fenced((torch.rand(k) + 0.5).to(dtype))
    s = x.double() + (residual.double() if with_residual else 0)
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.double()
    y = torch.randn(5, 96).to(dtype)
    expected = reference_64(normed, y, a, b, token_slots, offsets, rank_max)
    tol = TOL[dtype]
    for shrink, expand in ((lora_shrink, lora_expand), (lora_shrink_torch, lora_expand_torch)):
        partials = shrink(x, a, ranks, meta, (residual, norm_w, 1e-6))
        assert partials.shape[-1] == 2 * rank_max + 1
        grouped = [t for t, slot in enumerate(token_slots) if slot >= 0]
        mean_sq = partials[..., -1].sum(0)[grouped]
        torch.testing.assert_close(mean_sq.double(), s[grouped].pow(2).mean(-1), rtol=tol, atol=tol)
        out = nan_fenced(y, 99)
        expand(partials, b, ranks, offsets, out, meta, 1e-6)
        torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
        assert torch.equal(out[1], y[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gate_rank", [8, 0], ids=["both-shards", "up-only"])
def test_the_expand_adds_the_adapter_then_silu_and_mul(dtype, gate_rank):
    """lora_expand_silu over a merged gate|up (I = 72: two column tiles, the second ragged):
    silu(gate + its term) * (up + its term), each sum rounded as lora_expand stores it, into
    a new tensor, y untouched; an adapter that leaves gate alone still gives every column (the
    act of its token is whole). Every token here has an adapter (the one-row case)."""
    k, half, rank_max = 64, 72, 16
    ranks = [[gate_rank, 16], [4, 12]]
    a, b, rank_tensor, offsets = adapters(2, [half, half], k, rank_max, ranks, dtype)
    token_slots = [1, 0, 1]
    meta = metadata(token_slots, num_active=3)
    x = torch.randn(3, k).to(dtype)
    y = nan_fenced(torch.randn(3, 2 * half).to(dtype), 2 * half + 5)
    before = y.clone()
    partials = lora_shrink(x, a, rank_tensor, meta)
    act = lora_expand_silu(partials, b, rank_tensor, offsets, y, meta)
    assert torch.equal(y, before) and act.shape == (3, half)
    summed = reference_64(x, y, a, b, token_slots, offsets, rank_max).to(dtype)
    want = F.silu(summed[:, :half].double()) * summed[:, half:].double()
    tol = TOL[dtype]
    torch.testing.assert_close(act.double(), want, rtol=tol, atol=tol)
    twin = lora_expand_silu(lora_shrink_torch(x, a, rank_tensor, meta), b, rank_tensor,
                            offsets, y.clone(), meta)  # fmt: skip
    torch.testing.assert_close(twin.double(), want, rtol=tol, atol=tol)


def test_the_shrink_counts_its_splits_apart_from_the_projection_kernels(monkeypatch):
    """The shrink runs on a side stream beside the base projection (lora/layer.py), which may
    be a split-K kernel counting in dispatch.split_counts: sharing those counts, the two
    would mix their arrivals. The shrink's are a set of their own, zero after each call."""
    used = []
    counts = lora_module.split_counts

    def recorded(*args, **kwargs):
        used.append(counts(*args, **kwargs))
        return used[-1]

    monkeypatch.setattr(lora_module, "split_counts", recorded)
    a, _, ranks, _ = adapters(2, [64, 32, 32], 256, 16, [[16] * 3, [8] * 3], torch.float32)
    meta = metadata([1, 0, 1], num_active=2)
    partials = lora_shrink(torch.randn(3, 256), a, ranks, meta)
    assert partials.shape[0] == 1 and len(used) == 1  # split K, summed by the shrink
    assert used[0] is not dispatch.split_counts(torch.device("cpu"), "GEMV")
    assert not used[0].any()


def test_no_grouped_token_leaves_the_output_alone():
    a, b, ranks, offsets = adapters(2, [32], 64, 16, [[16], [16]], torch.float32)
    meta = metadata([-1, -1, -1], num_active=2)
    x, y = torch.randn(3, 64), torch.randn(3, 32)
    out = y.clone()
    lora_expand(lora_shrink(x, a, ranks, meta), b, ranks, offsets, out, meta)
    assert torch.equal(out, y)


def test_group_by_adapter_keeps_token_order_within_a_group():
    tokens, slots, starts, counts = group_by_adapter(np.array([2, -1, 0, 2, 0, -1, 3]))
    assert tokens.tolist() == [2, 4, 0, 3, 6]
    assert (slots.tolist(), starts.tolist(), counts.tolist()) == ([0, 2, 3], [0, 2, 4], [2, 2, 1])


def test_a_step_without_adapters_takes_the_fused_base_path(monkeypatch):
    """normed_projection through a LoRALinear where the small-batch kernel runs (forced on the
    CPU): in a step without adapters it takes the base's plan (the norm in the kernel's
    prologue, no norm kernel, no shrink) and gives the base Linear's own output; in a step with
    them at one row, still no norm kernel (the shrink reads the norm's input, the expand applies
    its 1/rms) and no SiLU kernel (the expand applies it): the projection plus the adapter term
    (the float64 reference); at two rows the norm kernel, the projection, the expand and the
    SiLU kernel."""
    monkeypatch.setattr(linear_module, "gemv_pays", lambda x, w, normed=False: True)
    k, half = 64, 48
    base = ColumnParallelLinear(k, [half, half])
    base.weight.data.copy_(torch.randn(2 * half, k) / k**0.5)
    layer = LoRALinear(base, num_slots=2, max_rank=8)
    for shard in (0, 1):
        layer.set_shard(1, shard, torch.randn(8, k) / k**0.5, torch.randn(half, 8))
    norm = RMSNorm(k, 1e-6)
    norm.weight.data.normal_()
    separate_norms, shrinks, silus = [], [], []
    norm_stream, shrink, silu = norm.stream, lora_layer.lora_shrink, linear_module.silu_and_mul
    monkeypatch.setattr(norm, "stream", lambda *a: separate_norms.append(1) or norm_stream(*a))
    monkeypatch.setattr(lora_layer, "lora_shrink", lambda *a: shrinks.append(1) or shrink(*a))
    monkeypatch.setattr(linear_module, "silu_and_mul", lambda y: silus.append(1) or silu(y))

    def gate_up(proj, x, residual, meta):
        with torch.no_grad(), forward_context(ForwardContext(None, [], None, meta)):
            return normed_projection(proj, norm, x.clone(), residual.clone(), silu=True)

    def reference(x, residual):
        stream = (x + residual).double()
        normed = stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + 1e-6)
        normed = normed * norm.weight.double()
        y = normed @ base.weight.double().T
        for shard in (0, 1):
            a = layer.lora_a[1, shard * 8 : (shard + 1) * 8].double()
            y[:, shard * half : (shard + 1) * half] += (
                normed @ a.T @ layer.lora_b[1, shard * half : (shard + 1) * half].double().T
            )
        gate, up = y.split(half, dim=1)
        return F.silu(gate) * up, stream

    x, residual = torch.randn(1, k), torch.randn(1, k)
    want = gate_up(base, x, residual, None)
    got = gate_up(layer, x, residual, None)
    assert not separate_norms and not shrinks and not silus
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for rows, unfused in ((1, False), (2, True)):
        x, residual = torch.randn(rows, k), torch.randn(rows, k)
        adapted = gate_up(layer, x, residual, metadata([1] * rows, num_active=2))
        assert shrinks and bool(separate_norms) == unfused and bool(silus) == unfused
        act, stream = reference(x, residual)
        torch.testing.assert_close(adapted[0].double(), act, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(adapted[1].double(), stream, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("normed", [False, True], ids=["o-residual", "qkv-norm"])
def test_an_adapter_at_one_row_keeps_the_base_fusions(normed, monkeypatch):
    """With an adapter at one row, a LoRALinear over a merged q|k|v (with a bias) takes its
    base's norm prologue (the expand applies the norm's 1/rms to the shrink's sums) and one
    over o adds the residual in its base's epilogue, then the adapter term, against float64
    math; no norm kernel, and the residual stream comes back as the fused paths give it."""
    monkeypatch.setattr(linear_module, "gemv_pays", lambda x, w, normed=False: True)
    k = 48
    base = ColumnParallelLinear(k, [32, 16, 16], bias=True) if normed else Linear(k, k)
    base.weight.data.copy_(torch.randn(base.weight.shape) / k**0.5)
    if normed:  # a q|k|v bias, as Qwen2's
        base.bias.data.normal_()
    shards = [32, 16, 16] if normed else [k]
    layer = LoRALinear(base, num_slots=2, max_rank=8)
    ranks = [8, 0, 4] if normed else [8]  # the adapter leaves k alone
    for shard, (size, rank) in enumerate(zip(shards, ranks, strict=True)):
        if rank:
            layer.set_shard(1, shard, torch.randn(rank, k) / k**0.5, torch.randn(size, rank))
    norm = RMSNorm(k, 1e-6)
    norm.weight.data.normal_()
    separate_norms, stream_of = [], norm.stream
    monkeypatch.setattr(norm, "stream", lambda *a: separate_norms.append(1) or stream_of(*a))
    x, residual = torch.randn(1, k), torch.randn(1, k)
    meta = metadata([1], num_active=2)
    with torch.no_grad(), forward_context(ForwardContext(None, [], None, meta)):
        if normed:
            y, stream = normed_projection(layer, norm, x, residual)
        else:
            y, stream = residual_projection(layer, x, residual)
    s = (x + residual).double()
    inp = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    inp = inp if normed else x.double()
    want = inp @ base.weight.double().T + (base.bias.double() if normed else 0)
    for shard, (lo, hi) in enumerate(zip(layer.offsets[:-1], layer.offsets[1:], strict=True)):
        a = layer.lora_a[1, shard * 8 : (shard + 1) * 8].double()
        want[:, lo:hi] += inp @ a.T @ layer.lora_b[1, lo:hi].double().T
    want = want if normed else want + residual.double()
    torch.testing.assert_close(y.double(), want, atol=1e-4, rtol=1e-4)
    assert not separate_norms
    assert stream is None if not normed else torch.allclose(stream.double(), s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_lora_residual_projection_without_adapters_is_its_base(dtype, monkeypatch):
    """residual_projection (o, down) through a LoRALinear over a plain Linear, where the
    small-batch kernel runs (forced on the CPU): the slots take the base's dtype (ranks int32,
    one shard), and a step without adapters takes the base's plan, the residual added in its
    epilogue, bit for bit the base Linear's output; where the kernel does not pay, the
    projection alone, the residual handed on."""
    monkeypatch.setattr(linear_module, "gemv_pays", lambda x, w, normed=False: True)
    base = Linear(64, 40)
    base.weight.data = (torch.randn(40, 64) / 8).to(dtype)
    layer = LoRALinear(base, num_slots=2, max_rank=8)
    assert (layer.lora_a.dtype, layer.lora_b.dtype, layer.lora_ranks.dtype) == (
        dtype,
        dtype,
        torch.int32,
    )
    assert layer.lora_a.shape == (2, 8, 64) and layer.lora_b.shape == (2, 40, 8)
    x, residual = torch.randn(1, 64).to(dtype), torch.randn(1, 40).to(dtype)
    with torch.no_grad(), forward_context(ForwardContext(None, [], None, None)):
        got = residual_projection(layer, x, residual)
        want = residual_projection(base, x, residual)
    assert got[1] is None and torch.equal(got[0], want[0])
    monkeypatch.setattr(linear_module, "gemv_pays", lambda x, w, normed=False: False)
    plain = Linear(64, 40)  # a new base: a Linear decides its plan once per input kind
    plain.weight.data = base.weight.data
    layer = LoRALinear(plain, num_slots=2, max_rank=8)  # no kernel: the add left to the norm
    with torch.no_grad(), forward_context(ForwardContext(None, [], None, None)):
        got = residual_projection(layer, x, residual)
    assert got[1] is residual and torch.equal(got[0], plain(x))
