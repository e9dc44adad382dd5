"""The Triton kernels on the GPU over realistic shapes in bfloat16, against float64 (or float32)
references, and paged attention with store_kv captured in a CUDA graph and replayed with other
lengths and block tables."""

import pytest
import torch

from ostinato.kernels import (
    fused_add_rms_norm,
    paged_attention,
    qk_norm_rope,
    rms_norm,
    rotary,
    silu_and_mul,
    store_kv,
)
from ostinato.kernels.kv_store import store_kv_torch
from ostinato.kernels.paged_attention import paged_attention_torch
from ostinato.kernels.qk_norm_rope import qk_norm_rope_torch

pytestmark = pytest.mark.gpu

NAN = float("nan")
BF16 = torch.bfloat16
BLOCK = 16


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def assert_rel(actual, expected, tol=1e-2):
    actual, expected = actual.double(), expected.double()
    err = ((actual - expected).norm() / expected.norm()).item()
    assert err < tol, f"relative error {err:.2e}"


def test_store_kv_bf16():
    tokens, kv_heads, head_dim, blocks = 4096, 8, 128, 1024
    kv = torch.randn(tokens, 2 * kv_heads, head_dim, device="cuda", dtype=BF16)
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    slots = torch.randperm(blocks * BLOCK, device="cuda")[:tokens]
    slots[::7] = -1
    caches = [
        torch.full((blocks, BLOCK, kv_heads, head_dim), NAN, device="cuda", dtype=BF16)
        for _ in "kvKV"
    ]
    store_kv(k, v, caches[0], caches[1], slots)
    store_kv_torch(k, v, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("tokens", [1, 4096])
def test_norms_bf16(tokens):
    x = torch.randn(tokens, 4096, device="cuda", dtype=BF16)
    residual = torch.randn(tokens, 4096, device="cuda", dtype=BF16)
    weight = torch.rand(4096, device="cuda", dtype=BF16) + 0.5
    expected = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert_rel(rms_norm(x, weight, 1e-6), expected * weight.double())
    total = x.double() + residual.double()
    expected = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    fused_add_rms_norm(x, residual, weight, 1e-6)
    assert_rel(residual, total)
    assert_rel(x, expected)


def test_rotary_bf16():
    tokens, heads, kv_heads, head_dim = 4096, 32, 8, 128
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=BF16)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, device="cuda") / head_dim)
    freqs = torch.outer(torch.arange(131072, device="cuda", dtype=torch.float), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    positions = torch.randint(0, 131072, (tokens,), device="cuda")
    cos, sin = cache[positions].double().unsqueeze(1).chunk(2, dim=-1)
    expected = []
    for t in (q, k):
        x1, x2 = t.double().chunk(2, dim=-1)
        expected.append(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
    rotary(q, k, positions, cache)
    assert_rel(q, expected[0])
    assert_rel(k, expected[1])


@pytest.mark.parametrize("heads, kv_heads", [(16, 8), (64, 8)])  # qwen3-0.6b, qwen3-32b
def test_qk_norm_rope_bf16(heads, kv_heads):
    """Against the unfused torch sequence: on the GPU bf16 rounds to nearest (the interpreter
    truncates), so nearly every element must be equal, not merely close."""
    tokens, head_dim, max_position = 4096, 128, 40960
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=BF16) * 3
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    q_weight, k_weight = (torch.rand(head_dim, device="cuda", dtype=BF16) + 0.5 for _ in "qk")
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, head_dim, 2, device="cuda") / head_dim)
    freqs = torch.outer(torch.arange(max_position, device="cuda", dtype=torch.float), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    positions = torch.randint(0, max_position, (tokens,), device="cuda")
    q_torch, k_torch = q.clone(), k.clone()
    qk_norm_rope_torch(q_torch, k_torch, q_weight, k_weight, 1e-6, positions, cache)
    qk_norm_rope(q, k, q_weight, k_weight, 1e-6, positions, cache)
    for ours, theirs in ((q, q_torch), (k, k_torch)):
        assert_rel(ours, theirs, tol=1e-3)
        assert (ours != theirs).float().mean() < 0.01


def test_silu_and_mul_bf16():
    x = torch.randn(2048, 2 * 14336, device="cuda", dtype=BF16)
    gate, up = x.double().chunk(2, dim=-1)
    assert_rel(silu_and_mul(x), torch.nn.functional.silu(gate) * up)


# ---- paged attention ---------------------------------------------------------------------


def make_batch(q_lens, seq_lens, heads, kv_heads, head_dim, pad_tokens=0):
    """Shuffled blocks; the cache is NaN outside the positions the requests own, and unused
    block-table entries point at an all-NaN block, so any stray read poisons the output."""
    used = [-(-s // BLOCK) for s in seq_lens]
    poison = sum(used)
    order = torch.randperm(poison, device="cuda")
    table = torch.full((len(seq_lens), max(used) + 1), poison, dtype=torch.int32, device="cuda")
    shape = (poison + 1, BLOCK, kv_heads, head_dim)
    k_cache = torch.full(shape, NAN, dtype=BF16, device="cuda")
    v_cache = torch.full(shape, NAN, dtype=BF16, device="cuda")
    start = 0
    for i, (n, s) in enumerate(zip(used, seq_lens, strict=True)):
        table[i, :n] = order[start : start + n]
        start += n
        fill_request(k_cache, v_cache, table[i], s)
    return dict(
        q=torch.randn(sum(q_lens) + pad_tokens, heads, head_dim, device="cuda", dtype=BF16),
        k_cache=k_cache,
        v_cache=v_cache,
        query_start_loc=cumulative(q_lens),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_table=table,
    )


def fill_request(k_cache, v_cache, table_row, seq_len):
    positions = torch.arange(seq_len, device="cuda")
    slots = table_row[positions // BLOCK].long() * BLOCK + positions % BLOCK
    kv_heads, head_dim = k_cache.shape[2:]
    for cache in (k_cache, v_cache):
        values = torch.randn(seq_len, kv_heads, head_dim, device="cuda", dtype=BF16)
        cache.view(-1, kv_heads, head_dim)[slots] = values


def cumulative(q_lens):
    return torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
    )


def attend(batch):
    out = torch.full_like(batch["q"], NAN)
    scale = batch["q"].shape[-1] ** -0.5
    paged_attention(
        batch["q"], batch["k_cache"], batch["v_cache"], out, batch["query_start_loc"],
        batch["seq_lens"], batch["block_table"], scale,
    )  # fmt: skip
    return out


def reference(batch):
    """float32 attention by the torch reference, on float32 copies of the bf16 inputs."""
    out = torch.full(batch["q"].shape, NAN, device="cuda")
    paged_attention_torch(
        batch["q"].float(), batch["k_cache"].float(), batch["v_cache"].float(), out,
        batch["query_start_loc"], batch["seq_lens"], batch["block_table"],
        batch["q"].shape[-1] ** -0.5,
    )  # fmt: skip
    return out


def check(batch, out):
    real = int(batch["query_start_loc"][-1])
    assert not out[:real].isnan().any()
    assert out[real:].isnan().all(), "a padding token's row was written"
    assert_rel(out[:real], reference(batch)[:real])


SHAPES = {  # heads, kv_heads, head_dim
    "llama-3.1-8b": (32, 8, 128),
    "qwen3-0.6b": (16, 8, 128),
    "qwen2.5-0.5b": (14, 2, 64),
    "mha": (16, 16, 128),
    "head256": (8, 1, 256),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_paged_attention_mixed_batch(shape):
    # idle request, long decode, chunked prefill, first token, fresh prefill, short chunk, padding
    q_lens = [0, 1, 300, 1, 1000, 5, 0]
    seq_lens = [500, 4000, 1000, 1, 1000, 70, 0]
    batch = make_batch(q_lens, seq_lens, *SHAPES[shape], pad_tokens=3)
    check(batch, attend(batch))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_reqs", [3, 64])
def test_paged_attention_decode(shape, num_reqs):
    seq_lens = torch.randint(1, 16384 if num_reqs == 3 else 4096, (num_reqs,)).tolist()
    batch = make_batch([1] * num_reqs, seq_lens, *SHAPES[shape])
    check(batch, attend(batch))


def test_paged_attention_long_prefill():
    batch = make_batch([4096], [4096], *SHAPES["llama-3.1-8b"])
    check(batch, attend(batch))


# ---- CUDA graphs ---------------------------------------------------------------------------


class Static:
    """Persistent buffers for a padded batch, as the runner keeps them."""

    def __init__(self, num_tokens, num_reqs, max_blocks, heads, kv_heads, head_dim, blocks):
        def new(*shape, dtype=BF16):
            return torch.zeros(*shape, dtype=dtype, device="cuda")

        self.q, self.out = new(num_tokens, heads, head_dim), new(num_tokens, heads, head_dim)
        self.k, self.v = new(num_tokens, kv_heads, head_dim), new(num_tokens, kv_heads, head_dim)
        self.k_cache = new(blocks, BLOCK, kv_heads, head_dim)
        self.v_cache = new(blocks, BLOCK, kv_heads, head_dim)
        self.slots = new(num_tokens, dtype=torch.int64)
        self.query_start_loc = new(num_reqs + 1, dtype=torch.int32)
        self.seq_lens = new(num_reqs, dtype=torch.int32)
        self.block_table = new(num_reqs, max_blocks, dtype=torch.int32)

    def step(self, caches=None):
        k_cache, v_cache = caches or (self.k_cache, self.v_cache)
        store_kv(self.k, self.v, k_cache, v_cache, self.slots)
        out = self.out if caches is None else torch.full_like(self.out, NAN)
        paged_attention(
            self.q, k_cache, v_cache, out, self.query_start_loc, self.seq_lens,
            self.block_table, self.q.shape[-1] ** -0.5,
        )  # fmt: skip
        return out

    def load(self, q_lens, seq_lens):
        """A new batch in place: fresh values, lengths, a shuffled block table, padding."""
        num_reqs, max_blocks = self.block_table.shape
        real = sum(q_lens)
        q_lens = q_lens + [0] * (num_reqs - len(q_lens))
        seq_lens = seq_lens + [0] * (num_reqs - len(seq_lens))
        self.query_start_loc.copy_(cumulative(q_lens))
        self.seq_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        order = torch.randperm(self.k_cache.shape[0], device="cuda")[: num_reqs * max_blocks]
        self.block_table.copy_(order.view(num_reqs, max_blocks))
        for cache in (self.q, self.k, self.v, self.k_cache, self.v_cache):
            cache.normal_()
        self.slots.fill_(-1)
        for i, (n, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
            first = int(self.query_start_loc[i])
            positions = torch.arange(s - n, s, device="cuda")
            row = self.block_table[i]
            self.slots[first : first + n] = (
                row[positions // BLOCK].long() * BLOCK + positions % BLOCK
            )
        self.out.fill_(NAN)
        return real


@pytest.mark.parametrize(
    "num_tokens, num_reqs, batches",
    [
        # FULL decode graph for 16 padded requests, replayed with fewer and longer ones
        (
            16,
            16,
            [([1] * 16, [100] * 16), ([1] * 5, [4000, 1, 17, 2048, 33]), ([1] * 9, [3000] * 9)],
        ),
        # one graph for 256 tokens of up to 4 requests: chunked prefills and decodes mixed
        (256, 4, [([200, 1, 1, 54], [900, 3000, 16, 54]), ([1, 255], [4000, 255]), ([7], [7])]),
    ],
)
def test_cuda_graph_replays_match_eager(num_tokens, num_reqs, batches):
    heads, kv_heads, head_dim = SHAPES["llama-3.1-8b"]
    static = Static(num_tokens, num_reqs, 256, heads, kv_heads, head_dim, blocks=num_reqs * 256)
    static.load(*batches[0])
    static.step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.step()
    for q_lens, seq_lens in batches:
        real = static.load(q_lens, seq_lens)
        caches = (static.k_cache.clone(), static.v_cache.clone())
        expected = static.step(caches)
        graph.replay()
        torch.testing.assert_close(static.out[:real], expected[:real], rtol=0, atol=0)
        assert static.out[real:].isnan().all(), "a padding token's row was written"
        torch.testing.assert_close(static.k_cache, caches[0], rtol=0, atol=0)
        torch.testing.assert_close(static.v_cache, caches[1], rtol=0, atol=0)
        batch = dict(
            q=static.q, k_cache=static.k_cache, v_cache=static.v_cache,
            query_start_loc=static.query_start_loc, seq_lens=static.seq_lens,
            block_table=static.block_table,
        )  # fmt: skip
        assert_rel(static.out[:real], reference(batch)[:real])
