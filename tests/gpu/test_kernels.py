"""The Triton kernels on the GPU over realistic shapes in bfloat16, against float64 (or float32)
references, and paged attention with the KV store captured in a CUDA graph and replayed with
other lengths and block tables."""

import pytest
import torch

from ostinato.kernels import (
    PagedAttention,
    fused_add_rms_norm,
    paged_attention,
    rms_norm,
    rope_and_store,
    silu_and_mul,
)
from ostinato.kernels.argmax import argmax_rows
from ostinato.kernels.gemv import gemv, gemv_normed, gemv_pays, rows_pay
from ostinato.kernels.nucleus import _top_p_mask_triton, top_p_mask_torch
from ostinato.kernels.paged_attention import Rope, choose_config
from ostinato.kernels.rope_store import rope_and_store_torch

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


def rope_cache(head_dim, max_position, theta):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device="cuda") / head_dim)
    freqs = torch.outer(torch.arange(max_position, device="cuda", dtype=torch.float), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize(
    "heads, kv_heads, norm",
    [(32, 8, False), (16, 8, True), (64, 8, True)],  # llama-3.1-8b, qwen3-0.6b, qwen3-32b
)
def test_rope_and_store_bf16(heads, kv_heads, norm):
    """Against the unfused torch sequence (norm, rotary, store): on the GPU bf16 rounds to
    nearest, so nearly every element must be equal, not merely close; slot -1 stores nothing."""
    tokens, head_dim, max_position, blocks = 4096, 128, 40960, 512
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=BF16) * 3
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    weights = [torch.rand(head_dim, device="cuda", dtype=BF16) + 0.5 for _ in "qk"]
    weights = weights if norm else [None, None]
    cache = rope_cache(head_dim, max_position, 1e6)
    positions = torch.randint(0, max_position, (tokens,), device="cuda")
    slots = torch.randperm(blocks * BLOCK, device="cuda")[:tokens]
    slots[::7] = -1
    shape = (blocks, BLOCK, kv_heads, head_dim)
    caches = [torch.full(shape, NAN, device="cuda", dtype=BF16) for _ in "kvKV"]
    twin = [t.clone() for t in (q, k, v)]
    rope_and_store_torch(*twin, positions, cache, caches[2], caches[3], slots, *weights, 1e-6)
    rope_and_store(q, k, v, positions, cache, caches[0], caches[1], slots, *weights, 1e-6)
    for ours, theirs in ((q, twin[0]), (k, twin[1]), (caches[0], caches[2])):
        written = ~theirs.isnan()
        assert torch.equal(~ours.isnan(), written)
        assert_rel(ours[written], theirs[written], tol=1e-3)
        assert (ours[written] != theirs[written]).float().mean() < 0.01
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0, equal_nan=True)


def test_silu_and_mul_bf16():
    x = torch.randn(2048, 2 * 14336, device="cuda", dtype=BF16)
    gate, up = x.double().chunk(2, dim=-1)
    assert_rel(silu_and_mul(x), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("vocab", [128256, 151936])
@pytest.mark.parametrize("rows", [1, 8, 32, 300])
def test_argmax_rows_is_torchs_argmax(rows, vocab, dtype):
    """The split argmax against torch's at llama-3.1-8b's and Qwen3's vocabularies: logits of
    random spread (bfloat16 rounding makes ties), some rows with a copied largest value in
    another chunk, a NaN after an earlier +inf, or all -inf; twice, so the counts reset."""
    logits = (torch.randn(rows, vocab, device="cuda") * 4).to(dtype)
    logits[::3, -1] = logits[::3].max(dim=-1).values  # ties into the last chunk
    logits[1::5, 0] = logits[1::5].max(dim=-1).values  # ties into the first chunk
    logits[2::7, 5000] = float("inf")
    logits[2::7, 70000] = NAN
    logits[3::11] = float("-inf")
    want = logits.argmax(dim=-1)
    for _ in range(2):
        assert torch.equal(argmax_rows(logits), want)


@pytest.mark.parametrize("rows", [1, 64, 256])
def test_nucleus_mask_keeps_what_a_sort_keeps(rows):
    """kernels/nucleus.py's kernel (which top_p_mask takes from KERNEL_MIN_ROWS rows) at
    Qwen3's vocabulary against the sort-based twin: the same tokens kept, from flat rows (a
    wide nucleus) to peaked ones, some with masked tokens."""
    logits = (
        torch.randn(rows, 151936, device="cuda")
        * torch.linspace(0.5, 12, rows, device="cuda")[:, None]
    )
    logits[::3, : 151936 // 3] = float("-inf")
    top_p = torch.tensor([0.9, 0.95, 0.5, 1.0, 0.999, 0.01, 0.7], device="cuda").repeat(rows)[:rows]
    got = _top_p_mask_triton(logits, top_p)
    want = top_p_mask_torch(logits, top_p)
    kept, wanted = torch.isfinite(got), torch.isfinite(want)
    assert torch.equal(got[kept], logits[kept])
    # float32 sums of up to 151,936 terms in another order (~2e-5 apart in a flat row, three
    # tokens' worth) may move a boundary by a few tokens
    moved = (kept != wanted).sum(dim=-1)
    assert (moved <= 16).all(), moved


@pytest.mark.parametrize("rows", [1, 2, 4, 8, 17, 32])
@pytest.mark.parametrize(
    "n, k, silu",
    [
        *[(4096, 1024, False), (1024, 2048, False), (6144, 1024, True), (1024, 3072, False)],
        *[(6144, 4096, False), (4096, 4096, False), (28672, 4096, True), (4096, 14336, False)],
    ],
)  # qwen3-0.6b's qkv, o, gate|up (+ SiLU), down; llama-3.1-8b's
def test_gemv_bf16_in_a_graph(rows, n, k, silu):
    """Against float64 at 1 row (FMAs) and 2-32 (tl.dot, K split for the narrow weights), and
    replays of the kernel captured in a CUDA graph with new inputs equal fresh launches (a
    split's sum is the same on every run)."""
    x = torch.randn(rows, k, device="cuda", dtype=BF16)
    weight = torch.randn(n, k, device="cuda", dtype=BF16) * 0.03
    expected = x.double() @ weight.double().T
    if silu:
        gate, up = expected.chunk(2, dim=-1)
        expected = torch.nn.functional.silu(gate) * up
    assert_rel(gemv(x, weight, silu_and_mul=silu), expected)
    assert gemv_pays(x, weight) == rows_pay(rows, n, k)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, weight, silu_and_mul=silu)
    x.normal_()
    graph.replay()
    torch.testing.assert_close(out, gemv(x, weight, silu_and_mul=silu), rtol=0, atol=0)


def silu_64(y):
    gate, up = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("rows", [1, 2, 32])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(
    "n, k, silu",
    [(4096, 1024, False), (6144, 1024, True), (6144, 4096, False), (28672, 4096, True)],
)
def test_gemv_normed_bf16_in_a_graph(n, k, silu, with_residual, rows):
    """The norm prologue (after the residual add) against float64 at qwen3-0.6b / llama-8b
    shapes (llama-3.1-8b's gate|up too, which takes the kernel at one row); replays of the
    captured kernel with new inputs equal fresh launches."""
    x = torch.randn(rows, k, device="cuda", dtype=BF16)
    residual = torch.randn(rows, k, device="cuda", dtype=BF16) if with_residual else None
    norm_w = torch.rand(k, device="cuda", dtype=BF16) + 0.5
    weight = torch.randn(n, k, device="cuda", dtype=BF16) * 0.03
    s = x.double() + (residual.double() if with_residual else 0)
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.double()
    expected = normed @ weight.double().T
    out, stream = gemv_normed(x, residual, norm_w, 1e-6, weight, silu_and_mul=silu)
    assert_rel(out, silu_64(expected) if silu else expected)
    assert_rel(stream, s, tol=4e-3)  # one bf16 rounding: about 1e-3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, stream = gemv_normed(x, residual, norm_w, 1e-6, weight, silu_and_mul=silu)
    x.normal_()
    if with_residual:
        residual.normal_()
    graph.replay()
    fresh, fresh_stream = gemv_normed(x, residual, norm_w, 1e-6, weight, silu_and_mul=silu)
    torch.testing.assert_close(out, fresh, rtol=0, atol=0)
    torch.testing.assert_close(stream, fresh_stream, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 2, 8, 16, 32])
def test_gemv_norm_rounds_as_the_unfused_norm(rows):
    """Through an identity weight the fused norm's output is the normalised input as the
    unfused norm rounds it: x / rms * norm weight in float32, rounded once to bf16. Scaling
    the product by 1/rms after the dot instead rounds x * norm weight first, and about a third
    of the values move by an ulp: that failed the bf16 HF oracle. (The CPU interpreter's bf16
    cast does not round to nearest, so this is a GPU test.) An ulp may still move where the
    sum of squares, taken in another order, changes 1/rms in its last bit: rarely."""
    k = 1024
    x = torch.randn(rows, k, device="cuda", dtype=BF16)
    residual = torch.randn(rows, k, device="cuda", dtype=BF16)
    norm_w = (torch.rand(k, device="cuda") + 0.5).to(BF16)
    eye = torch.eye(k, device="cuda", dtype=BF16)
    out, _ = gemv_normed(x, residual, norm_w, 1e-6, eye)
    expected = rms_norm(x + residual, norm_w, 1e-6)
    assert (out != expected).float().mean().item() <= 0.005


@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize("with_residual", [False, True])
def test_a_routers_gemv_stores_the_norm_for_the_experts(rows, with_residual):
    """normed_out at qwen3-30b-a3b's router (128 experts x 2048): the normalised rows as the
    norm kernel stores them (an ulp may move where 1/rms does, rarely), in a CUDA graph whose
    replays with new inputs equal fresh launches."""
    k = 2048
    x = torch.randn(rows, k, device="cuda", dtype=BF16)
    residual = torch.randn(rows, k, device="cuda", dtype=BF16) if with_residual else None
    norm_w = (torch.rand(k, device="cuda") + 0.5).to(BF16)
    router = torch.randn(128, k, device="cuda", dtype=BF16) * 0.03
    run = lambda: gemv_normed(x, residual, norm_w, 1e-6, router, normed_out=True)
    logits, stream, normed = run()
    expected = rms_norm(x if residual is None else x + residual, norm_w, 1e-6)
    assert (normed != expected).float().mean().item() <= 0.005
    assert_rel(logits, expected.double() @ router.double().T)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    x.normal_()
    graph.replay()
    for got, fresh in zip(captured, run(), strict=True):
        torch.testing.assert_close(got, fresh, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 3, 32])
@pytest.mark.parametrize(
    "n, k, silu", [(1024, 2048, False), (4096, 4096, False), (2048, 1024, True)]
)
def test_gemv_residual_epilogue_bf16(n, k, silu, rows):
    x = torch.randn(rows, k, device="cuda", dtype=BF16)
    weight = torch.randn(n, k, device="cuda", dtype=BF16) * 0.03
    add = torch.randn(rows, n // 2 if silu else n, device="cuda", dtype=BF16)
    y = x.double() @ weight.double().T
    assert_rel(
        gemv(x, weight, silu_and_mul=silu, add=add), (silu_64(y) if silu else y) + add.double()
    )


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
    """float64 attention written here (not the project's torch twin): each request's keys
    gathered through its block table, query j of n seeing the first s - n + j + 1 positions,
    head h reading KV head h // group."""
    q, k_cache, v_cache = batch["q"], batch["k_cache"], batch["v_cache"]
    out = torch.full(q.shape, NAN, device="cuda", dtype=torch.float64)
    starts = batch["query_start_loc"].tolist()
    group, scale = q.shape[1] // k_cache.shape[2], q.shape[-1] ** -0.5
    for i, s in enumerate(batch["seq_lens"].tolist()):
        a, b = starts[i], starts[i + 1]
        if a == b:
            continue
        pos = torch.arange(s, device="cuda")
        blocks = batch["block_table"][i, pos // BLOCK].long()
        k, v = (
            c[blocks, pos % BLOCK].double().repeat_interleave(group, 1) for c in (k_cache, v_cache)
        )
        scores = torch.einsum("nhd,shd->hns", q[a:b].double(), k) * scale
        query_pos = torch.arange(s - (b - a), s, device="cuda")
        scores.masked_fill_(pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        out[a:b] = torch.einsum("hns,shd->nhd", scores.softmax(dim=-1), v)
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


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_reqs, spec", [(1, 1), (8, 1), (32, 1), (4, 4)])
def test_merged_splits_match_the_combine_launch(shape, num_reqs, spec):
    """Eager steps merge a split KV in the attention kernel's last live part of each tile
    (merge=True); graphs launch the combine. Both run the same row merge; compiled into
    different kernels, its sums may round differently (head_dim 64 and 256 do), so they agree
    within rounding, and the merged launch gives the same bits on every repeat: a part that
    merged before the others had stored (a race) would not. spec: query tokens per request
    (a speculative verify)."""
    seq_lens = torch.randint(spec, 6000, (num_reqs,)).tolist()
    b = make_batch([spec] * num_reqs, seq_lens, *SHAPES[shape])
    args = (b["q"], b["k_cache"], b["v_cache"])
    meta = (b["query_start_loc"], b["seq_lens"], b["block_table"], b["q"].shape[-1] ** -0.5)
    config = choose_config(b["q"], b["k_cache"], b["block_table"], num_reqs)
    config = config._replace(splits=max(config.splits, 2))  # 32 requests may not split
    outs = {}
    for merge in (False, True):
        out = torch.full_like(b["q"], NAN)
        attention = PagedAttention(b["q"], out, b["k_cache"], *meta, config, merge=merge)
        assert (attention.combine is None) == merge
        outs[merge] = [attention(*args, out) or out.clone() for _ in range(20)]
    check(b, outs[True][0])
    assert_rel(outs[True][0], outs[False][0], tol=1e-3)
    for out in outs[True][1:]:
        assert torch.equal(out, outs[True][0])


def test_paged_attention_long_prefill():
    batch = make_batch([4096], [4096], *SHAPES["llama-3.1-8b"])
    check(batch, attend(batch))


def step_kv(batch):
    """This step's k and v as the engine has them (views of one qkv buffer): each request's
    new positions gathered from the cache; padding rows NaN."""
    q, k_cache = batch["q"], batch["k_cache"]
    heads, (kv_heads, head_dim) = q.shape[1], k_cache.shape[2:]
    qkv = torch.full((q.shape[0], heads + 2 * kv_heads, head_dim), NAN, dtype=BF16, device="cuda")
    k, v = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    starts, lens = batch["query_start_loc"].tolist(), batch["seq_lens"].tolist()
    for i, s in enumerate(lens):
        pos = torch.arange(s - (starts[i + 1] - starts[i]), s, device="cuda")
        slots = batch["block_table"][i, pos // BLOCK].long() * BLOCK + pos % BLOCK
        for new, cache in ((k, k_cache), (v, batch["v_cache"])):
            new[starts[i] : starts[i + 1]] = cache.view(-1, kv_heads, head_dim)[slots]
    return k, v


@pytest.mark.parametrize("shape", ["llama-3.1-8b", "qwen3-0.6b", "qwen2.5-0.5b"])
def test_fresh_prompts_read_from_the_steps_k_and_v(shape):
    """The engine's long-query launch (DIRECT: fresh prompts' KV from the step's k and v, the
    cache for chunks after context) at real shapes: fresh prompts of 1,000 and 513 tokens, a
    chunk of 700 after 1,300 cached, padding; equal to float64 and to the cache-only launch."""
    b = make_batch([1000, 700, 513, 0], [1000, 2000, 513, 0], *SHAPES[shape], pad_tokens=7)
    k, v = step_kv(b)
    meta = (b["query_start_loc"], b["seq_lens"], b["block_table"], b["q"].shape[-1] ** -0.5)
    out = torch.full_like(b["q"], NAN)
    attention = PagedAttention(b["q"], out, b["k_cache"], *meta, new_kv=k)
    assert attention.direct
    attention(b["q"], b["k_cache"], b["v_cache"], out, k, v)
    check(b, out)
    real = int(b["query_start_loc"][-1])
    assert_rel(out[:real], attend(b)[:real], tol=1e-3)


def test_direct_launches_match_triton_launches():
    """A PagedAttention launches through Triton once per argument alignment, then calls the
    compiled kernel's launcher itself: later layers (other q, caches and outputs), including a
    q that is not 16-byte aligned (a new specialisation), get the same results as fresh calls,
    the split partials reduced by the combine kernel's own direct launches."""
    heads, kv_heads, head_dim = SHAPES["llama-3.1-8b"]
    seq_lens = [700, 33, 2048, 1]
    first = make_batch([1] * 4, seq_lens, heads, kv_heads, head_dim)
    layers = [first] + [  # the next layers: their own q and KV at the same slots
        {
            **first,
            "q": torch.randn_like(first["q"]),
            **{
                c: torch.where(first[c].isnan(), first[c], torch.randn_like(first[c]))
                for c in ("k_cache", "v_cache")
            },
        }  # fmt: skip
        for _ in range(2)
    ]
    attention = PagedAttention(
        first["q"], first["q"], first["k_cache"], first["query_start_loc"], first["seq_lens"],
        first["block_table"], head_dim**-0.5,
    )  # fmt: skip
    shifted = torch.empty(first["q"].numel() + 1, device="cuda", dtype=BF16)[1:]
    layers[2]["q"] = shifted.view_as(first["q"]).copy_(layers[2]["q"])  # misaligned
    for _ in range(2):
        for layer in layers:
            out = torch.full_like(layer["q"], NAN)
            attention(layer["q"], layer["k_cache"], layer["v_cache"], out)
            assert torch.equal(out, attend(layer))
            check(layer, out)


@pytest.mark.parametrize("merge", [False, True])
def test_a_bound_launch_gives_the_instances_bits(merge):
    """PagedAttention.bind (a graph break's launch at replays: its arguments found once, the
    same q, out and caches every call): with new q values and new lengths written in place,
    each bound call gives the bits of calling the instance, its split KV merged in the
    attention kernel (eager instances) or by the combine launch (graphs')."""
    heads, kv_heads, head_dim = SHAPES["qwen3-0.6b"]
    b = make_batch([1] * 4, [3000] * 4, heads, kv_heads, head_dim)
    q, k_cache, v_cache = b["q"], b["k_cache"], b["v_cache"]
    config = choose_config(q, k_cache, b["block_table"], 4)
    config = config._replace(splits=max(config.splits, 2))
    out = torch.full_like(q, NAN)
    meta = (b["query_start_loc"], b["seq_lens"], b["block_table"], head_dim**-0.5)
    attention = PagedAttention(q, out, k_cache, *meta, config, merge=merge)
    assert (attention.combine is None) == merge
    attention(q, k_cache, v_cache, out)  # compiles the variants a bound call needs
    bound = attention.bind(q, k_cache, v_cache, out)
    for lens in ([2999, 17, 1500, 1], [1, 3000, 64, 2222]):
        b["seq_lens"].copy_(torch.tensor(lens))
        q.copy_(torch.randn_like(q))
        out.fill_(NAN)
        bound()
        got = out.clone()
        check(b, got)
        out.fill_(NAN)
        attention(q, k_cache, v_cache, out)
        assert torch.equal(got, out)


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
        # RoPE at position 0 with cos 1, sin 0: the identity, so a step may run twice
        self.positions = new(num_tokens, dtype=torch.int64)
        self.rope = torch.cat((torch.ones(1, head_dim // 2), torch.zeros(1, head_dim // 2)), 1)
        self.rope = self.rope.cuda()
        self.query_start_loc = new(num_reqs + 1, dtype=torch.int32)
        self.seq_lens = new(num_reqs, dtype=torch.int32)
        self.block_table = new(num_reqs, max_blocks, dtype=torch.int32)

    def step(self, caches=None):
        k_cache, v_cache = caches or (self.k_cache, self.v_cache)
        rope_and_store(
            self.q, self.k, self.v, self.positions, self.rope, k_cache, v_cache, self.slots
        )
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


class RotatingDecode:
    """Persistent buffers of a decode batch of num_reqs requests and a padding one, and the
    ROPE launch over them (rotating q and k, storing k and v): what a FULL decode graph holds."""

    WIDTH = 256  # blocks per request: up to 4,096 positions

    def __init__(self, num_reqs, heads, kv_heads, head_dim, norm):
        self.num_reqs, self.heads, self.kv_heads, self.head_dim = (
            num_reqs,
            heads,
            kv_heads,
            head_dim,
        )
        new = lambda *shape, dtype=BF16: torch.zeros(*shape, dtype=dtype, device="cuda")  # noqa: E731
        self.qkv = new(num_reqs + 1, heads + 2 * kv_heads, head_dim)
        self.q, self.k, self.v = self.qkv.split([heads, kv_heads, kv_heads], 1)
        self.out = torch.full_like(self.q, NAN)
        blocks = (num_reqs + 1) * self.WIDTH + 1
        self.k_cache, self.v_cache = (
            new(blocks, BLOCK, kv_heads, head_dim),
            new(blocks, BLOCK, kv_heads, head_dim),
        )
        self.slots = new(num_reqs + 1, dtype=torch.int64)
        self.query_start_loc = cumulative([1] * num_reqs + [0])
        self.seq_lens = new(num_reqs + 1, dtype=torch.int32)
        self.block_table = new(num_reqs + 1, self.WIDTH, dtype=torch.int32)
        self.weights = [torch.rand(head_dim, device="cuda", dtype=BF16) + 0.5 for _ in "qk"]
        self.weights = self.weights if norm else [None, None]
        self.table = rope_cache(head_dim, self.WIDTH * BLOCK, 1e6)
        self.attention = PagedAttention(
            self.q, self.out, self.k_cache, self.query_start_loc, self.seq_lens,
            self.block_table, head_dim**-0.5, new_kv=self.k,
            rope=Rope(self.table, self.slots, norm, 1e-6),
        )  # fmt: skip

    def __call__(self):
        self.attention(self.q, self.k_cache, self.v_cache, self.out, self.k, self.v, *self.weights)

    def load(self):
        """New lengths and blocks; the cache NaN but at each request's earlier positions;
        fresh unrotated q, k and v. -> the unfused result: (out, k_cache, v_cache)."""
        n, table = self.num_reqs, self.block_table
        seq_lens = torch.randint(1, self.WIDTH * BLOCK, (n,)).tolist()
        self.seq_lens.copy_(torch.tensor([*seq_lens, 0], dtype=torch.int32))
        table.copy_(torch.randperm(table.numel(), device="cuda").view(table.shape))
        for cache in (self.k_cache, self.v_cache):
            cache.fill_(NAN)
        for i, s in enumerate(seq_lens):
            fill_request(self.k_cache, self.v_cache, table[i], s)
        pos = self.seq_lens[:n].long() - 1
        self.slots[:n] = table[torch.arange(n), pos // BLOCK].long() * BLOCK + pos % BLOCK
        self.slots[n] = -1
        for cache in (self.k_cache, self.v_cache):
            cache.view(-1, self.kv_heads, self.head_dim)[self.slots[:n]] = NAN
        self.qkv.normal_()
        self.out.fill_(NAN)
        twin = dict(q=self.q.clone(), k_cache=self.k_cache.clone(), v_cache=self.v_cache.clone(),
                    query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
                    block_table=table)  # fmt: skip
        positions = torch.cat((pos, pos.new_zeros(1)))
        rope_and_store_torch(twin["q"], self.k.clone(), self.v.clone(), positions, self.table,
                             twin["k_cache"], twin["v_cache"], self.slots, *self.weights,
                             1e-6)  # fmt: skip
        return attend(twin), twin["k_cache"], twin["v_cache"]


@pytest.mark.parametrize("num_reqs", [1, 8, 64])
@pytest.mark.parametrize("shape, norm", [(s, s == "qwen3-0.6b") for s in SHAPES])
def test_a_decode_launch_rotates_and_stores_in_a_graph(shape, norm, num_reqs):
    """ROPE: captured in a CUDA graph and replayed with new lengths and blocks, the decode
    launch that rotates q and k (after the norms) and stores k and v equals RoPE + store, then
    attention, within bf16 rounding, and stores what they store; the padding request touches
    nothing."""
    step = RotatingDecode(num_reqs, *SHAPES[shape], norm)
    step.load()
    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        expected, k_cache, v_cache = step.load()
        graph.replay()
        assert not step.out[:num_reqs].isnan().any() and step.out[num_reqs:].isnan().all()
        assert_rel(step.out[:num_reqs], expected[:num_reqs])
        for ours, theirs in ((step.k_cache, k_cache), (step.v_cache, v_cache)):
            assert torch.equal(ours.isnan(), theirs.isnan())
            written = step.slots[:num_reqs]
            assert_rel(ours.flatten(0, 1)[written], theirs.flatten(0, 1)[written], tol=1e-3)


@pytest.mark.parametrize("shape", ["llama-3.1-8b", "qwen3-0.6b"])
def test_fresh_prompt_steps_through_sdpa_and_captured(shape):
    """A step of whole fresh prompts goes to torch's SDPA on this step's k and v; the same plan
    called inside a graph capture takes the paged kernel instead (lengths read on the device).
    Both equal float64 attention written here."""
    from ostinato.attention.triton_backend import SDPA_MIN_TOKENS, TritonAttentionBackend
    from ostinato.context import AttentionMetadata

    prompts, length = 2, SDPA_MIN_TOKENS // 2 + 16
    batch = make_batch([length] * prompts, [length] * prompts, *SHAPES[shape], pad_tokens=3)
    rows = torch.arange(length, device="cuda")
    k, v = (
        torch.cat(
            [c[batch["block_table"][i, rows // BLOCK].long(), rows % BLOCK] for i in range(prompts)]
            + [c[:1, :3].flatten(0, 1)]
        )  # fmt: skip
        for c in (batch["k_cache"], batch["v_cache"])
    )
    starts, lens = batch["query_start_loc"], batch["seq_lens"]
    meta = AttentionMetadata(
        batch["q"].shape[0], prompts, starts, lens, batch["block_table"],
        torch.full((batch["q"].shape[0],), -1, device="cuda"), starts.cpu(), lens.cpu(),
    )  # fmt: skip
    plan = TritonAttentionBackend().plan(meta)
    assert plan.fresh == (prompts, length)
    scale = batch["q"].shape[-1] ** -0.5
    eager = torch.full_like(batch["q"], NAN)
    plan(batch["q"], k, v, eager, batch["k_cache"], batch["v_cache"], scale)
    check(batch, eager)
    check(batch, attend(batch))  # also compiles the paged kernel before the capture
    graphed = torch.full_like(batch["q"], NAN)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan(batch["q"], k, v, graphed, batch["k_cache"], batch["v_cache"], scale)
    graph.replay()
    check(batch, graphed)


def test_a_packed_step_arrives_in_the_cuda_buffers_as_on_the_cpu():
    """InputBuffers on the GPU (pinned packed buffer, one copy, the compiled unpack kernel)
    leave every persistent buffer as the CPU's torch path does, over steps of changing sizes."""
    from test_input_buffers import buffers, largest_step, mixed_step

    from ostinato.runner.input_buffers import InputBuffers

    large = largest_step(first_block=2**23)  # slots past float32's exact integers
    cpu = buffers()
    gpu = InputBuffers(cpu.max_tokens, cpu.max_reqs, cpu.max_blocks, torch.device("cuda"))
    assert gpu.unpack.launch is not None and cpu.unpack.launch is None
    for step in (large, mixed_step(), large):
        gpu.load(step)
        cpu.load(step)
        torch.cuda.synchronize()
        for name, t in cpu.device.items():
            assert gpu.device[name].cpu().tolist() == t.tolist(), name
