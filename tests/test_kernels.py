"""The Triton kernels under TRITON_INTERPRET=1 on small shapes, against their torch versions and
a float64 reference. Outputs start as NaN so an element the kernel forgets to write fails; inputs
lie among NaNs (helpers.nan_fenced), so a read outside a tensor turns the output NaN, and the
tensors written in place keep their fences, so a write outside them fails too."""

import copy
import functools
import importlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import triton.language as tl
from helpers import close, fence_intact, nan_fenced
from triton.runtime.jit import JITFunction

from ostinato.attention.torch_backend import TorchAttentionBackend
from ostinato.attention.triton_backend import TritonAttentionBackend
from ostinato.kernels import (
    PagedAttention,
    fused_add_rms_norm,
    rms_norm,
    rope_and_store,
    silu_and_mul,
)
from ostinato.kernels.activation import silu_and_mul_torch
from ostinato.kernels.argmax import CHUNK, argmax_rows
from ostinato.kernels.dispatch import Kernel, interpreting, jit, split_counts
from ostinato.kernels.launch import Launch
from ostinato.kernels.norm import fused_add_rms_norm_torch, rms_norm_torch
from ostinato.kernels.paged_attention import (
    Config,
    LayerShape,
    Rope,
    choose_config,
    launch_classes,
    paged_attention_torch,
)
from ostinato.kernels.rope_store import rope_and_store_torch

# the package re-exports the function under the module's name, so reach the module itself
attention_module = importlib.import_module("ostinato.kernels.paged_attention")
norm_module = importlib.import_module("ostinato.kernels.norm")
launch_module = importlib.import_module("ostinato.kernels.launch")
paged_attention = attention_module.paged_attention

NAN = float("nan")


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)


def test_cpu_tensors_take_the_torch_path_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")

    def fail(*args):
        raise AssertionError("the Triton path ran on CPU tensors")

    monkeypatch.setattr(attention_module, "PagedAttention", fail)
    batch = make_batch([2], [5], 2, 1, 16, torch.float32)
    paged_attention(*batch.args(torch.empty_like(batch.q)), 0.25)


def test_each_call_takes_the_path_of_the_moment(monkeypatch):
    """interpreting() reads TRITON_INTERPRET at every call, not once: the tests switch it per
    test, and a kernel whose launch was cached under the interpreter takes the torch path on
    CPU tensors once it is off, and the interpreter again once it is back."""
    torch_calls, torch_path = [], norm_module.rms_norm_torch

    def spy(*args):
        torch_calls.append(1)
        return torch_path(*args)

    monkeypatch.setattr(norm_module, "rms_norm_torch", spy)
    x, weight = torch.randn(3, 64), torch.rand(64) + 0.5
    for value, interpreted in [("1", True), ("0", False), ("1", True), (None, False), ("1", True)]:
        if value is None:
            monkeypatch.delenv("TRITON_INTERPRET")
        else:
            monkeypatch.setenv("TRITON_INTERPRET", value)
        assert interpreting() is interpreted
        before = len(torch_calls)
        close(rms_norm(x, weight, 1e-6), rms_norm_64(x, weight, 1e-6), torch.float32)
        assert len(torch_calls) - before == (0 if interpreted else 1)


def test_interpreted_launch_leaves_triton_language_compiled():
    """The per-launch interpreter swaps triton.language's jitted functions back afterwards, so
    compiled kernels elsewhere in the process keep working."""
    silu_and_mul(torch.randn(2, 32))
    assert type(tl.sum) is JITFunction and type(tl.cdiv) is JITFunction


# ---- norms -------------------------------------------------------------------------------


def rms_norm_64(x, weight, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_rows_is_torchs_argmax_across_its_chunks(dtype):
    """The split argmax picks what torch's does: the first of equal largest values where they
    lie in different chunks (a later chunk's equal value loses, an earlier one wins), the first
    NaN over an earlier +inf, 0 in a row of -inf, on rows a stride wider than the vocabulary;
    and it leaves its counts at 0, so a second call gives the same."""
    vocab = 2 * CHUNK + 7  # three chunks, the last one ragged
    logits = torch.randn(5, vocab + 3).to(dtype)[:, :vocab]
    logits[0, [CHUNK + 1, 2 * CHUNK + 5]] = 9.0  # tie across chunks 1 and 2
    logits[1, [2 * CHUNK + 2, 3]] = 9.0  # tie across chunks 2 and 0
    logits[2, 2] = float("inf")
    logits[2, [CHUNK + 9, 2 * CHUNK]] = NAN
    logits[3] = float("-inf")
    logits[4, vocab - 1] = 9.0  # the ragged chunk's last column
    want = logits.argmax(dim=-1)
    assert want.tolist() == [CHUNK + 1, 3, CHUNK + 9, 0, vocab - 1]
    for _ in range(2):
        assert torch.equal(argmax_rows(logits), want)
        assert not split_counts(logits.device, "argmax").any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rows_and_strided_heads(dtype):
    x = nan_fenced((torch.randn(5, 96) * 3 + 1).to(dtype), 100)  # 96: narrower than its block
    weight = nan_fenced((torch.rand(96) + 0.5).to(dtype))
    out = rms_norm(x, weight, 1e-6)
    close(out, rms_norm_torch(x, weight, 1e-6), dtype)
    close(out, rms_norm_64(x, weight, 1e-6), dtype)
    # per-head norm on q viewed out of a fused qkv row (Qwen3's q_norm)
    qkv = nan_fenced(torch.randn(4, 7 * 32).to(dtype))
    q = qkv[:, : 5 * 32].view(4, 5, 32)
    head_weight = nan_fenced((torch.rand(32) + 0.5).to(dtype))
    out = rms_norm(q, head_weight, 1e-5)
    close(out, rms_norm_64(q, head_weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_in_place(dtype):
    x, residual = (nan_fenced(torch.randn(6, 200).to(dtype)) for _ in "xr")
    weight = nan_fenced((torch.rand(200) + 0.5).to(dtype))
    expected_x, expected_res = x.clone(), residual.clone()
    fused_add_rms_norm_torch(expected_x, expected_res, weight, 1e-6)
    reference_res = x.double() + residual.double()
    fused_add_rms_norm(x, residual, weight, 1e-6)
    close(residual, expected_res, dtype)
    close(x, expected_x, dtype)
    close(residual, reference_res, dtype)
    close(x, rms_norm_64(reference_res, weight, 1e-6), dtype)
    assert fence_intact(x) and fence_intact(residual)


def cos_sin_cache(head_dim, max_position, theta=10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def rotary_64(x, positions, cache):
    cos, sin = cache[positions].double().unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# ---- silu_and_mul ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 160), (2, 3, 2600)])  # 1300 > one 1024-wide block
def test_silu_and_mul(dtype, shape):
    x = nan_fenced((torch.randn(shape) * 3).to(dtype))
    out = silu_and_mul(x)
    gate, up = x.double().chunk(2, dim=-1)
    close(out, silu_and_mul_torch(x), dtype)
    close(out, torch.nn.functional.silu(gate) * up, dtype)


# ---- paged attention ---------------------------------------------------------------------


class Batch:
    """A paged batch whose cache is NaN except at the positions each request owns, so reading
    past a sequence, or through an unused block-table entry, poisons the output."""

    def __init__(self, q, k_cache, v_cache, query_start_loc, seq_lens, block_table, slots):
        self.q, self.k_cache, self.v_cache = q, k_cache, v_cache
        self.query_start_loc, self.seq_lens, self.block_table = (
            query_start_loc,
            seq_lens,
            block_table,
        )
        self.slots = slots  # per request: the flat cache slot of each KV position

    def args(self, out):
        return (self.q, self.k_cache, self.v_cache, out, self.query_start_loc, self.seq_lens,
                self.block_table)  # fmt: skip

    def reference_64(self, scale):
        """float64 attention per request; rows of padding tokens stay NaN."""
        out = torch.full(self.q.shape, NAN, dtype=torch.float64)
        flat_k = self.k_cache.flatten(0, 1).double()
        flat_v = self.v_cache.flatten(0, 1).double()
        starts = self.query_start_loc.tolist()
        for i, slots in enumerate(self.slots):
            if starts[i + 1] > starts[i]:
                q = self.q[starts[i] : starts[i + 1]].double()
                out[starts[i] : starts[i + 1]] = attention_64(
                    q, flat_k[slots], flat_v[slots], scale
                )
        return out


def attention_64(q, k, v, scale):
    """Written out, not the project's: q [n, H, D] are the last n of s positions with keys
    k [s, KH, D]; query j sees positions up to s - n + j; head h reads KV head h // group."""
    n, heads, _ = q.shape
    s, group = k.shape[0], heads // k.shape[1]
    out = torch.empty(n, heads, q.shape[2], dtype=torch.float64)
    for h in range(heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for j in range(n):
            seen = s - n + j + 1
            scores = (kh[:seen] @ q[j, h].double()) * scale
            weights = (scores - scores.max()).exp()
            out[j, h] = (weights / weights.sum()) @ vh[:seen]
    return out


def make_batch(q_lens, seq_lens, heads, kv_heads, head_dim, dtype, pad_tokens=0, block_size=16):
    """Requests get shuffled blocks; one spare column per block-table row and every unused entry
    point at an all-NaN block; q and the caches lie among NaNs."""
    used = [-(-s // block_size) for s in seq_lens]
    poison = sum(used)
    order = torch.randperm(poison).tolist()
    table = torch.full((len(seq_lens), max(used) + 1), poison, dtype=torch.int32)
    shape = (poison + 1, block_size, kv_heads, head_dim)
    k_cache, v_cache = (nan_fenced(torch.full(shape, NAN, dtype=dtype)) for _ in "kv")
    slots = []
    for i, (n, s) in enumerate(zip(used, seq_lens, strict=True)):
        table[i, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
        positions = torch.arange(s)
        slots.append(table[i, positions // block_size].long() * block_size + positions % block_size)
        k_cache.view(-1, kv_heads, head_dim)[slots[-1]] = torch.randn(s, kv_heads, head_dim).to(
            dtype
        )
        v_cache.view(-1, kv_heads, head_dim)[slots[-1]] = torch.randn(s, kv_heads, head_dim).to(
            dtype
        )
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = nan_fenced(torch.randn(sum(q_lens) + pad_tokens, heads, head_dim).to(dtype))
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    return Batch(q, k_cache, v_cache, query_start_loc, seq_lens, table, slots)


# idle request with context; decode across a block boundary; chunked prefill after 33 cached
# tokens; first token; fresh 37-token prefill; longer decode; a padded request (0, 0)
MIXED_Q = [0, 1, 7, 1, 37, 1, 0]
MIXED_SEQ = [25, 17, 40, 1, 37, 100, 0]


def run_attention(batch, config=None, merge=False):
    out = nan_fenced(torch.full(batch.q.shape, NAN, dtype=batch.q.dtype))
    scale = batch.q.shape[-1] ** -0.5
    if config is None and not merge:
        paged_attention(*batch.args(out), scale)
    else:
        b = batch
        PagedAttention(
            b.q, out, b.k_cache, b.query_start_loc, b.seq_lens, b.block_table, scale, config,
            merge=merge,
        )(b.q, b.k_cache, b.v_cache, out)  # fmt: skip
    return out, scale


def check_attention(batch, out, scale, dtype):
    real = int(batch.query_start_loc[-1])
    expected = torch.full_like(out, NAN)
    paged_attention_torch(*batch.args(expected), scale)
    reference = batch.reference_64(scale)
    assert not out[:real].isnan().any()
    assert out[real:].isnan().all() and fence_intact(out), "a padding token's row was written"
    close(out[:real], reference[:real], dtype, scale=10)
    close(out[:real], expected[:real], dtype, scale=10)


def config_for(kind, group):
    rows = lambda block_q: max(16, 1 << (block_q * group - 1).bit_length())
    return {
        "auto": None,
        "decode": Config(1, rows(1), 16, 4, num_warps=4, num_stages=1),
        "decode-split16": Config(1, rows(1), 16, 16, num_warps=4, num_stages=1),
        "tile2-split2": Config(2, rows(2), 16, 2, num_warps=4, num_stages=1),
        "prefill": Config(max(1, 64 // group), rows(max(1, 64 // group)), 32, 1, 4, 1),
    }[kind]


@pytest.mark.parametrize("kind", ["auto", "decode", "tile2-split2", "prefill"])
@pytest.mark.parametrize("group", [1, 2, 8])
def test_paged_attention_mixed_batch(kind, group):
    batch = make_batch(MIXED_Q, MIXED_SEQ, 2 * group, 2, 64, torch.float32, pad_tokens=2)
    out, scale = run_attention(batch, config_for(kind, group))
    check_attention(batch, out, scale, torch.float32)


@pytest.mark.parametrize("kind", ["decode", "tile2-split2", "decode-split16"])
@pytest.mark.parametrize("group", [1, 2, 8])
def test_merged_splits_equal_the_combine_launch(kind, group):
    """MERGE (eager steps): the last live part of each tile merges the parts itself, eight at
    a time with a running maximum (16 splits: up to 16 live parts, two rounds), equal to the
    combine launch within float32 rounding (the sums' order differs). Padding tokens stay
    unwritten and tiles of one part write their own rows."""
    lengths = [6 * n for n in MIXED_SEQ] if kind == "decode-split16" else MIXED_SEQ
    batch = make_batch(MIXED_Q, lengths, 2 * group, 2, 64, torch.float32, pad_tokens=2)
    out, scale = run_attention(batch, config_for(kind, group), merge=True)
    check_attention(batch, out, scale, torch.float32)
    combined, _ = run_attention(batch, config_for(kind, group))
    real = int(batch.query_start_loc[-1])  # the padding rows are NaN in both (checked)
    torch.testing.assert_close(out[:real], combined[:real], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "programs, most, splits",
    [(8, 64, 32), (8, 16, 16), (64, 64, 4), (256, 64, 1), (512, 64, 1), (32, 64, 8)],
)
def test_a_split_kv_aims_at_two_programs_per_sm(programs, most, splits):
    """132 SMs (an H100): one request of 8 KV heads splits in 32 (or as many as the block
    table allows), 8 requests in 4, 32 requests not at all (the H100 decode sweep's best)."""
    assert attention_module._splits(programs, 132, most) == splits


@pytest.mark.parametrize(
    "shape, width, sms, max_reqs, max_tokens",
    [
        (LayerShape(16, 128, 2, 16, 8), 128, 132, 40, 300),  # qwen3-0.6b on an H100
        (LayerShape(32, 128, 2, 16, 8), 128, 16, 40, 300),  # llama, few SMs: fewer splits
        (LayerShape(4, 64, 4, 16, 4), 2, 8, 40, 300),  # float32 MHA; short table: no split
        (LayerShape(16, 128, 2, 16, 8), 128, 132, 3, 20),  # 3 requests of up to 20 tokens
        (LayerShape(16, 128, 2, 16, 8), 128, 132, 64, 20),  # 20 tokens: the fullest batch
    ],
)  # fmt: skip
def test_launch_classes_reach_every_kernel_a_batch_can_launch(
    shape, width, sms, max_reqs, max_tokens
):
    """Start-up warm-up batches: for every batch of up to max_reqs requests and max_tokens
    tokens, the attention kernel it launches (its config; any split count >= 2 is one
    kernel) is one that some warm-up batch launches, and each warm-up batch launches its own."""
    kernel = lambda tokens, reqs: attention_module._config(shape, tokens, reqs, width, sms)
    one_kernel = lambda c: c._replace(splits=min(c.splits, 2))
    batches = launch_classes(shape, width, sms, max_reqs, max_tokens)
    warmed = [one_kernel(kernel(*batch)) for batch in batches]
    assert len(set(warmed)) == len(warmed)
    assert all(reqs <= max_reqs and reqs <= tokens <= max_tokens for tokens, reqs in batches)
    launched = {
        one_kernel(kernel(tokens, reqs))
        for reqs in range(1, max_reqs + 1)
        for tokens in range(reqs, max_tokens + 1)
    }
    assert launched == set(warmed)


def test_the_triton_backend_warms_up_its_launch_classes():
    """The backend's warm-up batches are launch_classes' for the layer the cache describes
    (8 SMs on the CPU)."""
    k_cache = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    got = TritonAttentionBackend().warm_up_batches(8, k_cache, 32, 64, 512)
    assert got == launch_classes(LayerShape(8, 64, 2, 16, 2), 32, 8, 64, 512)
    assert {min(t // r, 16) for t, r in got} == {1, 2, 4, 8, 16}  # every tile height, long
    assert TorchAttentionBackend().warm_up_batches(8, k_cache, 32, 64, 512) == []


def test_a_merging_launch_has_no_combine_and_needs_a_split():
    batch = make_batch([1, 1], [100, 90], 4, 2, 64, torch.float32)
    b, out = batch, torch.empty_like(batch.q)
    build = lambda splits, merge: PagedAttention(
        b.q, out, b.k_cache, b.query_start_loc, b.seq_lens, b.block_table, 0.125,
        Config(1, 16, 16, splits, num_warps=4, num_stages=1), merge=merge,
    )  # fmt: skip
    assert build(4, merge=False).combine is not None
    merged = build(4, merge=True)
    assert merged.combine is None and merged.attend.kwargs["MERGE"]
    counts = merged.attend.tail[4]  # one zeroed count per tile and KV head
    assert counts.shape == (2 * 2,) and not counts.any()
    combined = build(4, merge=False).attend
    assert combined.tail[4] is combined.tail[3]  # no counts (nothing zeroed in a capture)
    # one compiled kernel merges any split count: none is compiled mid-serving per count
    assert build(2, merge=True).attend.key == merged.attend.key == build(16, merge=True).attend.key
    unsplit = build(1, merge=True)
    assert not unsplit.attend.kwargs["MERGE"] and unsplit.attend.key == build(1, False).attend.key


@pytest.mark.parametrize("merge", [False, True])
def test_split_kv_follows_the_live_length(merge):
    """One launch object, as a graph replays it, over steps whose lengths change on the device:
    a long context splits into up to four parts, a short one runs as one part that writes its
    own output (the combine skips it), and a later medium one (two parts) never merges the
    partials the long step left in the parts it no longer uses. Merging in the kernel, each
    tile's count must be back at 0 for the next step, whose tiles count to another number."""
    batch = make_batch([1, 1], [100, 90], 4, 2, 64, torch.float32)
    out = torch.full(batch.q.shape, NAN)
    scale = 64**-0.5
    b = batch
    attention = PagedAttention(
        b.q, out, b.k_cache, b.query_start_loc, b.seq_lens, b.block_table, scale,
        Config(1, 16, 16, 4, num_warps=4, num_stages=1), merge=merge,
    )  # fmt: skip
    for lens in ([100, 90], [20, 3], [40, 70]):  # live parts: 4 4, 1 1, 2 3
        batch.seq_lens.copy_(torch.tensor(lens))
        out.fill_(NAN)
        attention(b.q, b.k_cache, b.v_cache, out)
        expected = torch.full_like(out, NAN)
        paged_attention_torch(*batch.args(expected), scale)
        close(out, expected, torch.float32, scale=10)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_paged_attention_head_dims(head_dim):
    batch = make_batch([3, 1, 20], [3, 33, 50], 4, 2, head_dim, torch.float32)
    out, scale = run_attention(batch)
    check_attention(batch, out, scale, torch.float32)


def test_paged_attention_half_precision_prefill_config():
    """Half-precision prompts (a fresh one and a chunk after context) take the tuned prefill tiles:
    64 rows, 64 KV positions per step."""
    batch = make_batch([70, 40], [70, 90], 8, 2, 128, torch.float16)
    table = torch.empty(2, 6, dtype=torch.int32)
    config = choose_config(batch.q, torch.empty(1, 16, 2, 128, dtype=torch.float16), table, 2)
    assert (config.block_q, config.block_m, config.block_n) == (16, 64, 64)
    out, scale = run_attention(batch)
    check_attention(batch, out, scale, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_attention_in_a_full_prefill_graph(dtype):
    """A step as a FULL prefill graph holds it: a chunk after 50 cached tokens and a fresh
    prompt, padded to 4 requests (two empty ones, length 0, whose block-table rows point at
    NaN) and 10 tokens past the real ones (of no request). The launch is the large-tile one
    of the 2 real requests, and writes exactly the real rows, as float64 attention has them."""
    batch = make_batch([40, 30, 0, 0], [90, 30, 0, 0], 4, 2, 64, dtype, pad_tokens=10)
    table = batch.block_table
    padded = choose_config(batch.q, batch.k_cache, table, 4)
    assert padded == choose_config(batch.q, batch.k_cache, table[:2], 2) and padded.block_q > 1
    out, scale = run_attention(batch)
    check_attention(batch, out, scale, dtype)


def new_kv_rows(batch, heads):
    """This step's k and v [tokens, kv_heads, head_dim] as the engine has them: views of one
    qkv buffer (row stride wider than a head's) holding what the cache holds at each request's
    new positions; padding rows NaN."""
    tokens, kv_heads, head_dim = batch.q.shape[0], *batch.k_cache.shape[2:]
    qkv = torch.full((tokens, heads + 2 * kv_heads, head_dim), NAN, dtype=batch.q.dtype)
    k, v = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    starts = batch.query_start_loc.tolist()
    for i, slots in enumerate(batch.slots):
        q_len = starts[i + 1] - starts[i]
        new = slots[len(slots) - q_len :]
        k[starts[i] : starts[i + 1]] = batch.k_cache.flatten(0, 1)[new]
        v[starts[i] : starts[i + 1]] = batch.v_cache.flatten(0, 1)[new]
    return k, v


def run_direct(batch, k, v):
    b, out = batch, nan_fenced(torch.full(batch.q.shape, NAN, dtype=batch.q.dtype))
    scale = b.q.shape[-1] ** -0.5
    attention = PagedAttention(
        b.q, out, b.k_cache, b.query_start_loc, b.seq_lens, b.block_table, scale, new_kv=k
    )
    attention(b.q, b.k_cache, b.v_cache, out, k, v)
    return attention, out, scale


# fresh prompts; chunks after 48 and 50 cached tokens; a 3-token chunk; padding requests and
# tokens
DIRECT_Q = [37, 40, 30, 3, 0, 0]
DIRECT_SEQ = [37, 88, 80, 20, 0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2])
def test_long_queries_read_their_new_kv_directly(dtype, group):
    """A long-query launch given this step's k and v (DIRECT) attends as the cache-only launch
    and float64 do, in a batch of fresh prompts, chunks after context and padding."""
    batch = make_batch(DIRECT_Q, DIRECT_SEQ, 2 * group, 2, 64, dtype, pad_tokens=5)
    attention, out, scale = run_direct(batch, *new_kv_rows(batch, 2 * group))
    assert attention.direct
    check_attention(batch, out, scale, dtype)


def test_fresh_prompts_read_k_and_v_and_chunks_read_the_cache():
    """DIRECT reads a fresh prompt's KV from k and v, and a chunk after context from the cache
    alone: with the cache NaN at the fresh prompt's positions and k and v NaN at the chunk's
    rows, the output is float64's of the real values; the cache-only launch reads NaN."""
    batch = make_batch([37, 40], [37, 88], 4, 2, 64, torch.float32)
    k, v = new_kv_rows(batch, 4)
    reference = batch.reference_64(64**-0.5)
    for cache in (batch.k_cache, batch.v_cache):
        cache.flatten(0, 1)[batch.slots[0]] = NAN
    k[37:], v[37:] = NAN, NAN
    attention, out, _ = run_direct(batch, k, v)
    assert not out.isnan().any()
    close(out, reference, torch.float32, scale=10)
    assert run_attention(batch)[0][:37].isnan().all()


def test_requests_past_their_context_read_nothing_new():
    """Warm-up batches clamp seq_len to the model length, below q_len: such a request's first
    tiles end before position 0. DIRECT must read no k or v rows for them (on the GPU, rows
    before the tensor fault): its outputs equal the cache-only launch's, NaN where no
    position is visible, not values from the fresh prompt's rows before it."""
    q_lens, seq_lens = [64, 128], [64, 40]
    batch = make_batch(q_lens, [64, 128], 4, 2, 64, torch.float32)
    batch.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    qkv = torch.randn(192, 8, 64)
    k, v = qkv[:, 4:6], qkv[:, 6:]
    k[:64] = batch.k_cache.flatten(0, 1)[batch.slots[0]]
    v[:64] = batch.v_cache.flatten(0, 1)[batch.slots[0]]
    _, out, _ = run_direct(batch, k, v)
    expected, _ = run_attention(batch)
    assert expected[64:].isnan().any() and not expected[:64].isnan().any()
    torch.testing.assert_close(out, expected, equal_nan=True)


def test_short_queries_and_split_launches_read_only_the_cache():
    """Decode-like batches (short queries) and split launches never take DIRECT, whatever k
    and v they are given."""
    decode = make_batch([1, 1, 2], [40, 9, 30], 4, 2, 64, torch.float32)
    assert not run_direct(decode, *new_kv_rows(decode, 4))[0].direct
    prefill = make_batch([37], [37], 4, 2, 64, torch.float32)
    b, out, k = prefill, torch.empty_like(prefill.q), new_kv_rows(prefill, 4)[0]
    split = Config(16, 64, 16, 2, num_warps=4, num_stages=1)
    args = (b.q, out, b.k_cache, b.query_start_loc, b.seq_lens, b.block_table, 0.125, split)
    assert not PagedAttention(*args, new_kv=k).direct


# decodes (one at position 0, one across a block boundary, long ones), padding requests; with
# a padding token, as many tokens as requests (a decode graph pads both alike)
ROPE_SEQ = [17, 1, 40, 100, 0, 0]


def rope_decode(group, dtype, norm, attend):
    """A decode batch whose q and new k and v rows come unrotated from the projection (views of
    one qkv buffer) and whose cache is NaN at the new tokens' slots: what
    attend(batch, q, k, v, out, rope, norm_weights) launches (and returns), checked against
    rope_and_store_torch followed by the torch reference attention, output and cache."""
    heads, kv_heads, head_dim, eps = 2 * group, 2, 64, 1e-6
    batch = make_batch([int(s > 0) for s in ROPE_SEQ], ROPE_SEQ, heads, kv_heads, head_dim,
                       dtype, pad_tokens=1)  # fmt: skip
    tokens, real = batch.q.shape[0], int(batch.query_start_loc[-1])
    qkv = nan_fenced(torch.randn(tokens, heads + 2 * kv_heads, head_dim).to(dtype))
    q, k, v = qkv.split([heads, kv_heads, kv_heads], 1)
    new_slots = [s[-1].item() for s in batch.slots if len(s)]
    slot_mapping = torch.tensor(new_slots + [-1] * (tokens - real))
    positions = torch.tensor([s - 1 for s in ROPE_SEQ if s] + [0] * (tokens - real))
    for cache in (batch.k_cache, batch.v_cache):
        cache.flatten(0, 1)[new_slots] = NAN  # what the launch must store, not read
    table = cos_sin_cache(head_dim, 128)
    weights = [(torch.rand(head_dim) + 0.5).to(dtype) for _ in "qk"] if norm else [None, None]
    caches = [c.clone() for c in (batch.k_cache, batch.v_cache)]
    expected = torch.full_like(batch.q, NAN)
    q_ref, k_ref, v_ref = q.clone(), k.clone(), v.clone()
    rope_and_store_torch(q_ref, k_ref, v_ref, positions, table, *caches, slot_mapping, *weights,
                         eps)  # fmt: skip
    b, scale = batch, head_dim**-0.5
    paged_attention_torch(q_ref, *caches, expected, b.query_start_loc, b.seq_lens, b.block_table,
                          scale)  # fmt: skip
    out = nan_fenced(torch.full(b.q.shape, NAN, dtype=dtype))
    attention = attend(b, q, k, v, out, Rope(table, slot_mapping, norm, eps), weights)
    assert not out[:real].isnan().any()
    assert out[real:].isnan().all() and fence_intact(out), "a padding token's row was written"
    close(out[:real], expected[:real], dtype, scale=10)
    for cache, reference in zip((b.k_cache, b.v_cache), caches, strict=True):
        close(cache.flatten(0, 1)[new_slots], reference.flatten(0, 1)[new_slots], dtype)
        unused = torch.ones(cache.flatten(0, 1).shape[0], dtype=torch.bool)
        unused[[s for slots in b.slots for s in slots.tolist()]] = False
        assert cache.flatten(0, 1)[unused].isnan().all() and fence_intact(cache)
    return attention


def paged_rope(config=None, merge=False):
    """rope_decode's attend: a PagedAttention with ROPE, as the plan builds it."""

    def attend(b, q, k, v, out, rope, weights):
        attention = PagedAttention(q, out, b.k_cache, b.query_start_loc, b.seq_lens,
                                   b.block_table, q.shape[-1] ** -0.5, config, merge, new_kv=k,
                                   rope=rope)  # fmt: skip
        attention(q, b.k_cache, b.v_cache, out, k, v, *weights)
        return attention

    return attend


@pytest.mark.parametrize("kind", ["auto", "decode", "decode-split16"])
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("norm", [False, True])
def test_a_decode_launch_rotates_stores_and_attends(kind, group, norm):
    """ROPE: the decode launch rotates q and k (after Qwen3's norms), and the part holding
    the new position (any of up to 16) stores k and v at the new slots and reads them back,
    as RoPE + store then attention do (a request at position 0 reads that token alone)."""
    assert rope_decode(group, torch.float32, norm, paged_rope(config_for(kind, group))).rope


@pytest.mark.parametrize("norm", [False, True])
def test_a_merging_decode_launch_rotates_too(norm):
    rope_decode(2, torch.float32, norm, paged_rope(config_for("decode-split16", 2), True))


def test_a_half_precision_decode_launch_rotates_as_the_unfused_kernels_round():
    rope_decode(2, torch.float16, True, paged_rope())


def test_paged_attention_half_precision_decode():
    batch = make_batch([1, 1, 1, 0], [16, 49, 5, 0], 8, 2, 64, torch.float16, pad_tokens=1)
    out, scale = run_attention(batch)
    check_attention(batch, out, scale, torch.float16)


def test_config_depends_on_shapes_and_splits_long_decodes(monkeypatch):
    monkeypatch.setattr(attention_module, "num_sms", lambda device, interpreted: 132)
    q = torch.empty(8, 32, 128)
    k_cache = torch.empty(10, 16, 8, 128)
    table = torch.empty(8, 512, dtype=torch.int32)  # up to 8k positions per request
    decode = choose_config(q, k_cache, table, num_reqs=8)
    assert decode.block_q == 1 and decode.splits > 1
    many = choose_config(torch.empty(256, 32, 128), k_cache, torch.empty(256, 512), num_reqs=256)
    assert many.splits == 1
    prefill = choose_config(torch.empty(4096, 32, 128), k_cache, table[:1], num_reqs=1)
    assert prefill.splits == 1 and prefill.block_m >= 64


def test_one_launch_object_serves_every_layer_of_a_step():
    """As in a step: one PagedAttention (config, grids, split scratch) built from the first
    layer, launched for a second layer with its own q and KV at the same slots; the KV split
    into 8 parts, several empty at these lengths, reduced by the combine kernel."""
    q_lens, seq_lens = [1, 1, 1, 1, 0], [5, 16, 17, 100, 0]
    first = make_batch(q_lens, seq_lens, 4, 2, 32, torch.float32, pad_tokens=1)
    second = copy.copy(first)
    second.q = torch.randn_like(first.q)
    second.k_cache, second.v_cache = (
        torch.where(c.isnan(), c, torch.randn_like(c)) for c in (first.k_cache, first.v_cache)
    )
    config = Config(1, 16, 16, 8, num_warps=4, num_stages=1)
    attention = PagedAttention(
        first.q, first.q, first.k_cache, first.query_start_loc, first.seq_lens,
        first.block_table, 32**-0.5, config,
    )  # fmt: skip
    for layer in (first, second):
        out = torch.full_like(layer.q, NAN)
        attention(layer.q, layer.k_cache, layer.v_cache, out)
        check_attention(layer, out, 32**-0.5, torch.float32)


def test_launch_keys_separate_what_triton_specialises_on():
    """A cached compiled kernel is reused only for arguments Triton would compile alike."""
    from ostinato.kernels.launch import _specialisation

    spec = _specialisation
    assert spec(1) != spec(2) != spec(16)
    assert spec(16) == spec(32) and spec(3) == spec(5)
    assert spec(2**31) != spec(2**31 - 16)
    assert spec(0.5) == spec(0.25) and spec(True) != spec(1)
    x = torch.zeros(64, dtype=torch.float32)
    assert spec(x) == spec(x[4:]) != spec(x[1:])  # 16 bytes in: aligned; 4 bytes: not
    assert spec(x) != spec(x.view(torch.int32))


@jit
def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    tl.store(y_ptr + cols, tl.load(x_ptr + cols, mask=cols < n), mask=cols < n)


def test_per_call_tensors_key_on_dtype_and_alignment(monkeypatch):
    """A direct Launch reuses a compiled kernel only for head tensors of the same dtypes and
    16-byte alignment, and hands the launcher their pointers; any other head goes through
    Triton (here a stub that counts its compiles)."""
    monkeypatch.delenv("TRITON_INTERPRET")  # a direct launch
    compiles, launched = [], []

    class Compiled:
        function = packed_metadata = None

        @staticmethod
        def run(*args):
            launched.append(args)

    def compile_and_run(self, *args, grid, warmup, **kwargs):
        compiles.append(args)
        return Compiled

    monkeypatch.setattr(Kernel, "run", compile_and_run)
    monkeypatch.setattr(launch_module, "_current_stream", lambda device: 0)
    monkeypatch.setattr(launch_module, "_compiled", {})
    launch = Launch(_copy_kernel, (1, 1, 1), num_head=2, tail=(48,), constexprs={"BLOCK": 64})
    x = torch.zeros(64, dtype=torch.float32)
    i = x.view(torch.int32)
    heads = [(x, x[4:]), (x, x[1:]), (x[1:], x), (x, i), (i, x)]  # x[1:]: 4 bytes in
    for head in heads:
        launch(*head)
    assert len(compiles) == len(heads) and not launched
    for head in [*heads, (x[8:], x)]:  # x[8:]: aligned, as x
        launch(*head)
    assert len(compiles) == len(heads) and len(launched) == len(heads) + 1
    pointers = (x[8:].data_ptr(), x.data_ptr())
    assert launched[-1][:3] == (1, 1, 1) and launched[-1][9:] == (*pointers, 48, 64)


def test_a_bound_launch_calls_the_launcher_as_a_launch_would(monkeypatch):
    """Launch.bind (a graph break's launch, its tensors the same every call): None while the
    head's variant is not compiled; then a call without arguments that launches exactly what
    launch(*head) does, taking the current stream at each call."""
    monkeypatch.delenv("TRITON_INTERPRET")  # a direct launch
    launched, compiles = [], []

    class Compiled:
        function, packed_metadata = "f", (4, 1, 0)

        @staticmethod
        def run(*args):
            launched.append(args)

    monkeypatch.setattr(Kernel, "run", lambda self, *a, **kw: compiles.append(a) or Compiled)
    streams = iter(range(10, 20))
    monkeypatch.setattr(launch_module, "_current_stream", lambda device: next(streams))
    monkeypatch.setattr(launch_module, "_compiled", {})
    monkeypatch.setattr(launch_module.triton, "__version__", "3.9.0")  # the launcher itself
    launch = Launch(_copy_kernel, (3, 2, 1), num_head=2, tail=(48,), constexprs={"BLOCK": 64})
    x, y = torch.zeros(64), torch.zeros(64)
    assert launch.bind(x, y) is None  # nothing compiled yet
    launch(x, y)  # compiles
    bound = launch.bind(x, y)
    assert launch.bind(x[1:], y) is None  # another alignment: another variant, not compiled
    launch(x, y)  # stream 10
    bound()  # stream 11
    bound()  # stream 12
    assert len(compiles) == 1 and len(launched) == 3
    head = ((4, 1, 0), None, None, None, x.data_ptr(), y.data_ptr(), 48, 64)
    assert launched == [(3, 2, 1, stream, "f", *head) for stream in (10, 11, 12)]


def test_triton36_launches_skip_the_launchers_python(monkeypatch):
    """Where the compiled kernel's launcher is Triton 3.6's and the kernel needs no scratch, a
    cached launch calls its C launch with the arguments CudaLauncher.__call__ would add
    (cooperative, PDL, no scratch); with scratch, or another Triton version, the launcher."""
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(launch_module, "_current_stream", lambda device: 7)
    calls = []

    class CudaLauncher:  # the shape of Triton 3.6's
        launch_cooperative_grid, launch_pdl, profile_scratch_size = False, True, 0

        def __init__(self, scratch):
            self.global_scratch_size = scratch

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            calls.append(("launcher", gridX, gridY, gridZ, stream, function, *args))

        @staticmethod
        def launch(*args):
            calls.append(("c", *args))

    x, y = torch.zeros(64), torch.zeros(64)
    ptrs = (x.data_ptr(), y.data_ptr())
    for version, scratch, want in [
        ("3.6.0", 0, ("c", 2, 1, 1, 7, "f", False, True, None, None, (4, 1, 0), None, None,
                      None, *ptrs, 48, 64)),
        ("3.6.0", 256, ("launcher", 2, 1, 1, 7, "f", (4, 1, 0), None, None, None, *ptrs, 48, 64)),
        ("3.9.0", 0, ("launcher", 2, 1, 1, 7, "f", (4, 1, 0), None, None, None, *ptrs, 48, 64)),
    ]:  # fmt: skip
        compiled = types.SimpleNamespace(
            run=CudaLauncher(scratch), function="f", packed_metadata=(4, 1, 0)
        )
        monkeypatch.setattr(Kernel, "run", lambda self, *a, c=compiled, **kw: c)
        monkeypatch.setattr(launch_module.triton, "__version__", version)
        monkeypatch.setattr(launch_module, "_compiled", {})
        launch_module._passes_through.cache_clear()
        launch = Launch(_copy_kernel, (2, 1, 1), num_head=2, tail=(48,), constexprs={"BLOCK": 64})
        launch(x, y)  # compiles
        launch(x, y)
        assert calls.pop() == want and not calls


# ---- rope + KV store ---------------------------------------------------------------------


class RopeCase:
    """q, k, v as views of a fused qkv projection, as the model splits them; NaN caches; slots
    with -1 (padding) among them; Qwen3-style norm weights. Every tensor among NaNs."""

    def __init__(self, tokens, heads, kv_heads, head_dim, dtype, blocks=6, page=16):
        width = (heads + 2 * kv_heads) * head_dim
        self.qkv = nan_fenced((torch.randn(tokens, width) * 3 + 1).to(dtype))
        q, k, v = self.qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], 1)
        self.q = q.view(tokens, heads, head_dim)
        self.k = k.view(tokens, kv_heads, head_dim)
        self.v = v.view(tokens, kv_heads, head_dim)
        self.weights = [nan_fenced((torch.rand(head_dim) + 0.5).to(dtype)) for _ in "qk"]
        self.positions = torch.randint(0, 4096, (tokens,))
        self.positions[0] = 4095  # the table's last row
        self.cache = nan_fenced(cos_sin_cache(head_dim, 4096))
        shape = (blocks, page, kv_heads, head_dim)
        self.caches = [nan_fenced(torch.full(shape, NAN, dtype=dtype)) for _ in "kv"]
        self.slots = torch.randperm(blocks * page)[:tokens]
        self.slots[:: max(1, tokens // 3)] = -1

    def clone(self):
        twin = copy.copy(self)
        twin.qkv = self.qkv.clone()
        twin.q, twin.k, twin.v = (t.clone() for t in (self.q, self.k, self.v))
        twin.caches = [c.clone() for c in self.caches]
        return twin

    def run(self, fn, norm, eps=1e-6):
        weights = self.weights if norm else [None, None]
        fn(self.q, self.k, self.v, self.positions, self.cache, *self.caches, self.slots,
           *weights, eps)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize(
    "group, kv_heads, head_dim", [(1, 2, 64), (2, 2, 128), (8, 2, 64), (3, 2, 32), (2, 3, 96)]
)  # 2 x 3 + 3 heads and a half of 48: tiles padded past both
def test_rope_and_store(group, kv_heads, head_dim, norm, dtype):
    """q and k rotated in place (after per-head RMSNorm with `norm`), k and v stored at their
    slots and nowhere else, v itself untouched: against the unfused torch sequence and a
    float64 reference."""
    case = RopeCase(9, kv_heads * group, kv_heads, head_dim, dtype)
    twin = case.clone()
    v_before = case.v.clone()
    q_in, k_in = case.q.clone(), case.k.clone()
    if norm:
        q_in = rms_norm_64(q_in, case.weights[0], 1e-6).to(dtype)
        k_in = rms_norm_64(k_in, case.weights[1], 1e-6).to(dtype)
    case.run(rope_and_store, norm)
    twin.run(rope_and_store_torch, norm)
    close(case.q, twin.q, dtype)
    close(case.k, twin.k, dtype)
    close(case.q, rotary_64(q_in, case.positions, case.cache), dtype)
    close(case.k, rotary_64(k_in, case.positions, case.cache), dtype)
    assert torch.equal(case.v, v_before)
    for ours, theirs in zip(case.caches, twin.caches, strict=True):
        written = ~ours.isnan()
        assert torch.equal(written, ~theirs.isnan())
        close(ours[written], theirs[written], dtype)
    stored = case.slots[case.slots >= 0]
    assert torch.equal(case.caches[1].flatten(0, 1)[stored], v_before[case.slots >= 0])
    k_rows = case.caches[0].flatten(0, 1)
    assert (~k_rows.isnan()).flatten(1).all(1).sum() == len(stored)
    assert all(fence_intact(t) for t in (case.qkv, *case.caches))


@pytest.mark.parametrize("in_one_step", [False, True])
def test_rope_launches_follow_each_calls_layout(in_one_step):
    """The cached launch is keyed by the layout it was built for: q, k and v as views of one
    qkv row, then as separate tensors of the same shapes (other strides), each as the
    unfused sequence gives them; also where both calls are layers of one forward step, which
    find their launch by a shorter key (`step`)."""
    views = RopeCase(5, 4, 2, 64, torch.float32)
    step = {} if in_one_step else None
    for case in (views, views.clone()):
        twin = case.clone()
        case.run(functools.partial(rope_and_store, step=step), True)
        twin.run(rope_and_store_torch, True)
        close(case.q, twin.q, torch.float32)
        close(case.k, twin.k, torch.float32)
        assert torch.equal(case.caches[1].isnan(), twin.caches[1].isnan())
        close(case.caches[1].nan_to_num(), twin.caches[1].nan_to_num(), torch.float32)


def test_rope_and_store_rounds_like_the_unfused_layers():
    """The normalised values round to the dtype before rotating, as the unfused norm stored
    them: skipping that rounding changes ~30% of the elements, keeping it leaves only the rare
    ones where fp32 sums round differently. float16, because the interpreter truncates
    float32 -> bfloat16 where the GPU rounds to nearest."""
    case = RopeCase(16, 16, 8, 128, torch.float16)
    twin = case.clone()
    case.run(rope_and_store, norm=True)
    twin.run(rope_and_store_torch, norm=True)
    assert (case.q != twin.q).float().mean() < 0.01
    assert (case.k != twin.k).float().mean() < 0.01


def test_cached_launches_follow_each_calls_token_count():
    """Norms, activation and RoPE keep one cached launch per shape of a row, whatever the
    token count: calls of more, then fewer, then more rows than the first one all cover their
    rows (and no more), against float64 math."""
    dtype = torch.float32
    weight = (torch.rand(96) + 0.5).to(dtype)
    for rows in (5, 2, 9):
        x = torch.randn(rows, 96)
        close(rms_norm(x, weight, 1e-6), rms_norm_64(x, weight, 1e-6), dtype)
        x, residual = torch.randn(rows, 96), torch.randn(rows, 96)
        total = x.double() + residual.double()
        fused_add_rms_norm(x, residual, weight, 1e-6)
        close(x, rms_norm_64(total, weight, 1e-6), dtype)
        gate_up = torch.randn(rows, 2 * 40).double()
        gate, up = gate_up.chunk(2, dim=-1)
        close(silu_and_mul(gate_up.float()), gate * torch.sigmoid(gate) * up, dtype)
        case = RopeCase(rows, 4, 2, 64, dtype)
        q_in = rms_norm_64(case.q.clone(), case.weights[0], 1e-6).to(dtype)
        case.run(rope_and_store, True)
        close(case.q, rotary_64(q_in, case.positions, case.cache), dtype)
        v_rows = case.caches[1].flatten(0, 1)
        assert (~v_rows.isnan()).flatten(1).all(1).sum() == (case.slots >= 0).sum()


def _metadata(q_lens, seq_lens, pad_tokens=0, uniform_query_len=None):
    from ostinato.context import AttentionMetadata

    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    tokens = sum(q_lens) + pad_tokens
    table = torch.zeros(len(q_lens), 4, dtype=torch.int32)
    slots = torch.full((tokens,), -1, dtype=torch.int64)
    return AttentionMetadata(
        tokens, len(q_lens), starts, lens, table, slots, starts, lens, uniform_query_len
    )


@pytest.mark.parametrize(
    "q_lens, seq_lens, expected",
    [
        ([8, 8, 8], [8, 8, 8], (3, 8)),  # whole fresh prompts of one length
        ([16], [16], (1, 16)),  # one long prompt, a long prompt's first chunk
        ([8, 8, 0], [8, 8, 0], (2, 8)),  # then a padded request
        ([8, 8], [8, 9], None),  # one token cached before the second prompt's chunk
        ([8, 7], [8, 7], None),  # two lengths
        ([8, 0, 8], [8, 0, 8], None),  # padding between prompts
        ([1, 1], [5, 9], None),  # decodes
        ([4, 4], [4, 4], None),  # below SDPA_MIN_TOKENS
        ([0, 0], [0, 0], None),  # nothing but padding
    ],
)
def test_fresh_prompt_steps_are_recognised(monkeypatch, q_lens, seq_lens, expected):
    from ostinato.attention import triton_backend

    monkeypatch.setattr(triton_backend, "SDPA_MIN_TOKENS", 16)
    assert triton_backend.fresh_prompts(_metadata(q_lens, seq_lens)) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prompts_attend_over_their_own_keys(monkeypatch, dtype):
    """A step of fresh prompts reads this step's k and v, not the cache (NaN here): each prompt
    equals causal attention written out in float64, padding rows stay unwritten."""
    from ostinato.attention import triton_backend

    monkeypatch.setattr(triton_backend, "SDPA_MIN_TOKENS", 16)
    prompts, length, heads, kv_heads, dim, pad = 3, 9, 4, 2, 16, 5
    tokens = prompts * length + pad
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim,
                                                            kv_heads * dim], 1))  # fmt: skip
    cache = torch.full((4, 16, kv_heads, dim), NAN, dtype=dtype)
    out = torch.full((tokens, heads, dim), NAN, dtype=dtype)
    plan = triton_backend.TritonAttentionBackend().plan(
        _metadata([length] * prompts, [length] * prompts, pad_tokens=pad)
    )
    scale = dim**-0.5
    plan(q, k, v, out, cache, cache, scale)
    for p in range(prompts):
        rows = slice(p * length, (p + 1) * length)
        close(out[rows], attention_64(q[rows], k[rows], v[rows], scale), dtype, scale=10)
    assert out[prompts * length :].isnan().all()


def test_graph_warm_ups_and_captures_keep_the_paged_kernel(monkeypatch):
    """A graph's warm-up (variants recording) must launch what its capture will: the paged
    kernel, never SDPA, whatever the batch looks like."""
    from ostinato.attention import triton_backend
    from ostinato.kernels import variants

    monkeypatch.setattr(triton_backend, "SDPA_MIN_TOKENS", 16)
    sdpa_calls = []
    monkeypatch.setattr(triton_backend, "causal_prefill", lambda *a: sdpa_calls.append(a))
    q, k = torch.randn(16, 2, 16), torch.randn(16, 1, 16)
    cache = torch.zeros(4, 16, 1, 16)
    plan = triton_backend.TritonAttentionBackend().plan(_metadata([8, 8], [8, 8]))
    with variants.recording():
        plan(q, k, k, torch.empty_like(q), cache, cache, 0.25)
    assert not sdpa_calls
    plan(q, k, k, torch.empty_like(q), cache, cache, 0.25)
    assert len(sdpa_calls) == 1


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("norm", [False, True])
def test_a_rotating_plan_hands_its_launch_the_rotation(monkeypatch, graph, norm):
    """Through the Triton backend's plan, a decode step given a Rotation gets a ROPE launch:
    eager (kept in the cache of eager launches) and as a graph's capture builds it (not kept);
    the output and the cache are RoPE + store's, then attention's."""
    from ostinato.attention import triton_backend
    from ostinato.attention.base import Rotation
    from ostinato.context import AttentionMetadata

    if graph:
        monkeypatch.setattr(triton_backend, "_capturing", lambda t: True)
    backend = triton_backend.TritonAttentionBackend()

    def attend(b, q, k, v, out, rope, weights):
        meta = AttentionMetadata(q.shape[0], len(b.seq_lens), b.query_start_loc, b.seq_lens,
                                 b.block_table, rope.slot_mapping, b.query_start_loc,
                                 b.seq_lens, uniform_query_len=1)  # fmt: skip
        plan = backend.plan(meta)
        assert plan.rotates
        rotation = Rotation(rope.cos_sin_cache, *weights, rope.eps)
        plan(q, k, v, out, b.k_cache, b.v_cache, q.shape[-1] ** -0.5, rotation)
        (launch,) = plan.launches.values()
        return launch

    launch = rope_decode(2, torch.float32, norm, attend)
    assert launch.rope and (launch in backend.eager.launches.values()) is not graph


@pytest.mark.parametrize(
    "q_lens, uniform, eager, graphed",
    [
        ([1], 1, True, False),  # one request: eager steps only (ROTATE_MIN_REQS)
        ([1, 1], 1, True, True),
        ([1, 1, 0], 1, True, True),  # and a padding request
        ([1, 0], 1, True, True),  # one token, a padding request: a graph of two
        ([1, 1], None, False, False),  # a FULL graph of 2 tokens and 2 requests (mode full) ...
        ([2, 0], None, False, False),  # ... which also replays a chunk of one request
        ([2, 2], 2, False, False),  # a verify step
        ([0], 1, False, False),  # nothing to attend
        ([0, 0], 1, False, False),
    ],
)
def test_decode_steps_rotate_in_the_attention_launch(q_lens, uniform, eager, graphed):
    """plan.rotates: steps whose key has one token per request, from two requests in a graph,
    from one eagerly. A plan made for a live step that then serves as a graph's warm-up and
    capture (lazy capture) answers as the capture's own plan does."""
    from ostinato.attention import triton_backend
    from ostinato.kernels import variants

    meta = _metadata(q_lens, [9] * len(q_lens), uniform_query_len=uniform)
    live = triton_backend.TritonAttentionBackend().plan(meta)
    assert live.rotates is eager
    with variants.recording():
        assert live.rotates is graphed
        with variants.warm_only():
            assert live.rotates is graphed
            assert triton_backend.TritonAttentionBackend().plan(meta).rotates is graphed


class _Steps:
    """Eager steps through one backend over persistent metadata buffers, as the runner makes
    them (slices of its buffers: the same addresses every step), on one KV cache."""

    def __init__(self, monkeypatch):
        from ostinato.attention import triton_backend

        self.full = make_batch([1] * 4, [60, 50, 40, 30], 4, 2, 32, torch.float32)
        self.query_start_loc = torch.zeros(5, dtype=torch.int32)
        self.seq_lens = torch.zeros(4, dtype=torch.int32)
        self.backend = triton_backend.TritonAttentionBackend()
        self.built, self.merged = [], []  # what each PagedAttention was built with
        build = triton_backend.PagedAttention

        def spy(*args, merge=False, **kwargs):
            self.merged.append(merge)
            self.built.append(build(*args, merge=merge, **kwargs))
            return self.built[-1]

        monkeypatch.setattr(triton_backend, "PagedAttention", spy)

    def run(self, q_lens, seq_lens, q=None, out=None):
        """One step; returns the PagedAttention its layers launched. Given q and out (a graph
        break's: the same tensors every replay), new values are written into them."""
        from ostinato.context import AttentionMetadata

        n, tokens = len(q_lens), sum(q_lens)
        self.query_start_loc[: n + 1] = torch.tensor([0, *torch.tensor(q_lens).cumsum(0)])
        self.seq_lens[:n] = torch.tensor(seq_lens)
        f = self.full
        slots = [s[:length] for s, length in zip(f.slots, seq_lens, strict=False)]
        q = torch.empty(tokens, 4, 32) if q is None else q
        q.copy_(torch.randn(tokens, 4, 32))
        step = Batch(q, f.k_cache, f.v_cache, self.query_start_loc[: n + 1], self.seq_lens[:n],
                     f.block_table[:n], slots)  # fmt: skip
        meta = AttentionMetadata(tokens, n, step.query_start_loc, step.seq_lens,
                                 step.block_table, torch.zeros(tokens, dtype=torch.int64),
                                 step.query_start_loc, step.seq_lens)  # fmt: skip
        plan = self.backend.plan(meta)
        out = torch.empty_like(step.q) if out is None else out
        out.fill_(NAN)
        plan(step.q, *new_kv_rows(step, 4), out, f.k_cache, f.v_cache, 32**-0.5)
        check_attention(step, out, 32**-0.5, torch.float32)
        (launch,) = plan.launches.values()
        return launch


def test_steps_give_fresh_prompts_launches_their_k_and_v(monkeypatch):
    """The backend hands each launch the step's k and v: a step of a fresh prompt (below
    SDPA's size) reads them (DIRECT) and attends right; a decode step does not take DIRECT."""
    steps = _Steps(monkeypatch)
    assert steps.run([37], [37]).direct
    assert not steps.run([1, 1], [60, 50]).direct


def test_eager_steps_keep_their_attention_launches(monkeypatch):
    """Eager steps of one form share a PagedAttention across steps, whatever their lengths
    (read on the device); a step with another request count gets its own even where the token
    count and the buffers' addresses are the same, and the first comes back after it."""
    steps = _Steps(monkeypatch)
    first = steps.run([1, 1], [20, 33])
    assert steps.run([1, 1], [60, 9]) is first and len(steps.built) == 1
    one_request = steps.run([2], [45])
    assert one_request is not first and len(steps.built) == 2
    assert steps.run([1, 1], [50, 50]) is first and len(steps.built) == 2


def test_a_graph_breaks_replays_bind_its_attention_launch_at_the_second_replay(monkeypatch):
    """A break's call in replays (replay_memo: a memo per break) passes the same q, out and
    caches every time. The plan binds the launch at the second replay in a row with the same
    instance and caches, and calls what it bound from the third on, with new lengths and
    values. A new instance for the step (the eager cache dropped the old one) or another k or
    v cache array starts over; steps whose instances alternate (their request counts do) never
    bind. Every output is right."""
    from ostinato.attention import triton_backend
    from ostinato.kernels.paged_attention import PagedAttention

    steps = _Steps(monkeypatch)
    memo, binds = {}, []
    monkeypatch.setattr(triton_backend, "replay_memo", lambda: memo)
    bind = PagedAttention.bind
    monkeypatch.setattr(PagedAttention, "bind", lambda s, *a: binds.append(s) or bind(s, *a))
    q = torch.empty(2, 4, 32)
    out = torch.empty_like(q)

    def replays(*lengths) -> set:
        return {steps.run([1, 1], lens, q, out) for lens in lengths}

    (first,) = replays([20, 33])
    assert binds == []
    assert replays([60, 9], [5, 50], [33, 1]) == {first} and binds == [first]
    steps.backend.eager.launches.clear()
    (second,) = replays([41, 2], [17, 30], [2, 41])
    assert second is not first and binds == [first, second]
    f = steps.full
    for cache in ("k_cache", "v_cache"):  # another array, other values
        setattr(f, cache, getattr(f, cache) * 2 - 1)
        bound = len(binds)
        assert replays([50, 50]) == {second} and len(binds) == bound
        assert replays([7, 44], [44, 7]) == {second} and binds[bound:] == [second]
    one_request = [steps.run([2], [45], q, out), steps.run([1, 1], [9, 9], q, out)]
    one_request += [steps.run([2], [30], q, out), steps.run([1, 1], [3, 3], q, out)]
    assert len(binds) == 4 and one_request[0] is not second  # alternating: never bound
    # the breaks' own instances leave a split KV to the combine launch, as graphs do
    assert steps.merged == [False, False, False]


def test_graph_captures_and_warm_ups_neither_take_nor_fill_the_eager_cache(monkeypatch):
    """A graph keeps using the scratch of the PagedAttention it captured: a captured one must
    never be one the eager cache may later drop (its memory would go back to the allocator),
    and a warm-up's (on the capture stream) must not stay in the cache either."""
    from ostinato.attention import triton_backend
    from ostinato.kernels import variants

    steps = _Steps(monkeypatch)
    eager = steps.run([1, 1], [20, 33])
    with monkeypatch.context() as capture:
        capture.setattr(triton_backend, "_capturing", lambda t: True)
        captured = steps.run([1, 1], [20, 33])
    with variants.recording():
        warm_up = steps.run([1, 1], [20, 33])
    assert len({id(eager), id(captured), id(warm_up)}) == 3
    assert list(steps.backend.eager.launches.values()) == [eager]
    assert steps.run([1, 1], [20, 33]) is eager
    # eager steps merge a split KV in the attention kernel; graphs keep the combine launch
    assert steps.merged == [True, False, False]


TRITON_KEY_RUN = """
import json
from triton.runtime import cache
from ostinato.kernels import triton_key
hashing = cache.triton_key
thread = triton_key.prepare()
if thread is not None:
    thread.join()
key = cache.triton_key()  # what the first compile or disk-cache lookup calls
saved = str(triton_key.saved_key_path())
print(json.dumps([thread is not None, hashing.cache_info().misses, key, saved]))
"""


def test_triton_key_is_hashed_once_per_install_then_read_back(tmp_path):
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}
    run = [sys.executable, "-c", TRITON_KEY_RUN]
    first, second = (json.loads(subprocess.check_output(run, env=env)) for _ in range(2))
    assert first[:2] == [True, 1]  # hashed in a thread, into triton_key's own cache
    assert Path(first[3]).read_text() == first[2] and Path(first[3]).parent == tmp_path
    assert second == [False, 0, first[2], first[3]]  # read back, never hashed


def test_the_saved_triton_key_is_named_by_every_file_of_the_install(tmp_path):
    from ostinato.kernels.triton_key import saved_key_path

    (tmp_path / "_C").mkdir()
    (tmp_path / "_C" / "libtriton.so").write_bytes(b"build one")
    (tmp_path / "cache.py").write_text("x = 1")
    named = saved_key_path(tmp_path)
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "cache.pyc").write_bytes(b"imports write these")
    assert saved_key_path(tmp_path) == named
    (tmp_path / "_C" / "libtriton.so").write_bytes(b"build two")  # same size, newer
    os.utime(tmp_path / "_C" / "libtriton.so", ns=(1, 1))
    assert saved_key_path(tmp_path) != named
