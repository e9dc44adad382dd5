"""The batched LoRA kernels under TRITON_INTERPRET=1 against their torch versions and a float64
per-token reference: mixed adapters, tokens with none, ranks below the slot size, a shard the
adapter leaves alone, split K, and padded groups; the fused decode kernel against the same
reference, and the layer's choice between the two."""

import numpy as np
import pytest
import torch

from ostinato.context import ForwardContext, LoRAMetadata, forward_context
from ostinato.kernels.lora import (
    FUSED_MAX_TOKENS,
    FusedConfig,
    fused_config,
    lora_expand,
    lora_expand_torch,
    lora_fused,
    lora_shrink,
    lora_shrink_torch,
)
from ostinato.lora import layer as lora_module
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
    return a.to(dtype), b.to(dtype), rank_tensor, tuple(offsets)


def reference_64(x, y, a, b, token_slots, offsets, rank_max):
    out = y.double().clone()
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for h, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
            a_h = a[slot, h * rank_max : (h + 1) * rank_max].double()
            out[t, lo:hi] += b[slot, lo:hi].double() @ (a_h @ x[t].double())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("num_tokens", "shard_sizes", "k"),
    [(5, [64, 32, 32], 256), (40, [48], 80), (3, [96, 96], 64)],  # split K; odd widths; 2 shards
)
def test_shrink_expand_match_torch_and_reference(dtype, num_tokens, shard_sizes, k):
    rank_max, slots = 16, 3
    ranks = [[8] * len(shard_sizes), [16] * len(shard_sizes), [4] * len(shard_sizes)]
    ranks[0][-1] = 0  # adapter in slot 0 leaves its last shard alone
    a, b, rank_tensor, offsets = adapters(slots, shard_sizes, k, rank_max, ranks, dtype)
    token_slots = torch.randint(-1, slots, (num_tokens,)).tolist()
    token_slots[0], token_slots[-1] = -1, 1
    meta = metadata(token_slots, num_active=4)  # more groups than adapters: padded ones
    x = torch.randn(num_tokens, k).to(dtype)
    y = torch.randn(num_tokens, sum(shard_sizes)).to(dtype)
    expected = reference_64(x, y, a, b, token_slots, offsets, rank_max)

    y_torch = y.clone()
    lora_expand_torch(lora_shrink_torch(x, a, rank_tensor, meta), b, rank_tensor, offsets,
                      y_torch, meta)  # fmt: skip
    partials = lora_shrink(x, a, rank_tensor, meta)
    y_triton = y.clone()
    lora_expand(partials, b, rank_tensor, offsets, y_triton, meta)

    tol = TOL[dtype]
    for got in (y_torch, y_triton):
        torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)
    untouched = [t for t, s in enumerate(token_slots) if s < 0]
    assert torch.equal(y_triton[untouched], y[untouched])
    assert not torch.equal(y_triton, y)
    if num_tokens == 5:
        assert partials.shape[0] > 1  # the decode-sized case splits K


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


FUSED_CASES = [  # (tokens, shard widths, K, FusedConfig or None: fused_config's)
    (5, [64, 32, 32], 200, FusedConfig(cols=32, block_n=16, block_k=64, num_warps=4,
                                       num_stages=1)),  # K not a multiple of block_k
    (7, [48, 80, 24], 72, FusedConfig(cols=48, block_n=16, block_k=32, num_warps=4,
                                      num_stages=1)),  # shards of unequal tiles, cols split
    (20, [40], 56, None),  # two token tiles
    (4, [96, 96], 64, None),
]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_tokens", "shard_sizes", "k", "config"), FUSED_CASES)
def test_fused_matches_reference(dtype, num_tokens, shard_sizes, k, config):
    """Every adapter at a rank below the slot's (0 on one shard), the slots' rows beyond each
    rank filled with noise the kernel must not read, tokens of no adapter, padded groups."""
    rank_max, slots = 16, 3
    ranks = [[8] * len(shard_sizes), [16] * len(shard_sizes), [3] * len(shard_sizes)]
    ranks[0][-1] = 0  # adapter in slot 0 leaves its last shard alone
    ranks[2][0] = 0  # and the one in slot 2 its first
    shards = len(shard_sizes)
    a = torch.randn(slots, shards * rank_max, k).div(k**0.5).to(dtype)
    b = torch.randn(slots, sum(shard_sizes), rank_max).to(dtype)
    offsets = (0, *np.cumsum(shard_sizes).tolist())
    token_slots = torch.randint(-1, slots, (num_tokens,)).tolist()
    token_slots[:4] = [-1, 0, 2, 1]  # every adapter and a token of none
    if num_tokens > 16:
        token_slots[4:] = [1] * (num_tokens - 4)  # a group of more than one token tile
    x = torch.randn(num_tokens, k).to(dtype)
    y = torch.randn(num_tokens, sum(shard_sizes)).to(dtype)
    expected = y.double()
    for t, slot in enumerate(token_slots):
        for h in range(shards if slot >= 0 else 0):
            r, (lo, hi) = ranks[slot][h], offsets[h : h + 2]
            shrunk = a[slot, h * rank_max : h * rank_max + r].double() @ x[t].double()
            expected[t, lo:hi] += b[slot, lo:hi, :r].double() @ shrunk

    got = y.clone()
    ranks = torch.tensor(ranks, dtype=torch.int32)
    lora_fused(x, a, b, ranks, offsets, got, metadata(token_slots, num_active=4), config)

    torch.testing.assert_close(got.double(), expected, rtol=TOL[dtype], atol=TOL[dtype])
    untouched = [t for t, s in enumerate(token_slots) if s < 0]
    assert torch.equal(got[untouched], y[untouched])


def test_fused_config_keeps_the_programs_near_the_target():
    """llama-3.1-8b's gate|up at one token: 512 columns a program (56 programs); at 32 tokens
    of 4 adapters the columns grow with the groups, never past the widest shard."""
    gate_up = [14336, 14336]
    assert fused_config(gate_up, 1, 1, 16, 2).cols == 512
    wide = fused_config(gate_up, 32, 4, 16, 2)
    programs = sum(-(-w // wide.cols) for w in gate_up) * 5  # 4 groups + 1 extra token tile
    assert programs <= 64 and wide.cols == 4096
    assert fused_config([200], 1, 100, 16, 2).cols == 256  # one tile covers the shard


def lora_layer(shard_sizes, k, dtype):
    """A LoRALinear over a plain linear of these shards, adapters in its 3 slots."""
    base = torch.nn.Linear(k, sum(shard_sizes), bias=False).to(dtype)
    base.out_sizes = shard_sizes
    layer = LoRALinear(base, num_slots=3, max_rank=16)
    ranks = [[8, 16], [16, 0], [4, 4]]
    a, b, _, offsets = adapters(3, shard_sizes, k, 16, ranks, dtype)
    for slot in range(3):
        for shard in range(len(shard_sizes)):
            r = ranks[slot][shard]
            rows = slice(shard * 16, shard * 16 + r)
            layer.set_shard(
                slot, shard, a[slot, rows], b[slot, offsets[shard] : offsets[shard + 1], :r]
            )
    return layer, a, b, offsets


@pytest.mark.parametrize("num_tokens", [FUSED_MAX_TOKENS, FUSED_MAX_TOKENS + 1])
def test_layer_takes_the_fused_kernel_up_to_its_token_limit(monkeypatch, num_tokens):
    layer, a, b, offsets = lora_layer([48, 32], 40, torch.float32)

    def fail(*args, **kwargs):
        raise AssertionError("the other LoRA path ran")

    fused = num_tokens <= FUSED_MAX_TOKENS
    monkeypatch.setattr(lora_module, "lora_shrink" if fused else "lora_fused", fail)
    token_slots = [(t % 4) - 1 for t in range(num_tokens)]
    x = torch.randn(num_tokens, 40)
    ctx = ForwardContext(None, [], None, lora=metadata(token_slots, num_active=4))
    with forward_context(ctx):
        got = layer(x)
    expected = reference_64(x, layer.base(x), a, b, token_slots, offsets, 16)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)
