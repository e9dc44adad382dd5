"""Ostinato's models against Hugging Face transformers on the same random checkpoints: packed
varlen prefill through a hand-built paged KV cache, then a mixed step reusing the cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers import make_hf_checkpoint

from ostinato.attention.torch_backend import TorchAttentionBackend
from ostinato.config import EngineConfig
from ostinato.context import AttentionMetadata, ForwardContext, forward_context
from ostinato.kernels.fp8 import SplitSum
from ostinato.layers import linear as linear_module
from ostinato.layers.norm import RMSNorm
from ostinato.loader import load_hf_config, load_model
from ostinato.models.base import IntermediateTensors
from ostinato.quantization import QuantSpec, building

BLOCK = 16
# Scattered, out-of-order blocks, so a paging mistake shows.
BLOCK_TABLE = torch.tensor([[3, 0, 0], [7, 1, 0], [2, 9, 5]], dtype=torch.int32)
PROMPT_LENS = [5, 17, 33]  # within one block, just over one, over two
STEP2_LENS = [1, 3, 1]  # decode, a prefill chunk, decode


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral"])
def checkpoint(request, tmp_path_factory):
    return make_hf_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def load(path, layer_range=None):
    config = EngineConfig(model=str(path), device="cpu", dtype="float32")
    return load_model(config, load_hf_config(str(path)), layer_range)


def kv_caches(hf_config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (10, BLOCK, hf_config.num_key_value_heads, hf_config.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(hf_config.num_hidden_layers)]


def step_metadata(starts: list[int], lens: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and metadata for request i computing tokens [starts[i], starts[i] + lens[i])."""
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens, strict=True)])
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    slots = BLOCK_TABLE[req, positions // BLOCK].long() * BLOCK + positions % BLOCK
    query_start_loc = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([s + n for s, n in zip(starts, lens, strict=True)], dtype=torch.int32)
    meta = AttentionMetadata(
        num_tokens=len(positions),
        num_reqs=len(lens),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=BLOCK_TABLE,
        slot_mapping=slots,
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        uniform_query_len=lens[0] if len(set(lens)) == 1 else None,
    )
    return positions, meta


def run(model, kv, input_ids, positions, meta) -> torch.Tensor:
    with torch.no_grad(), forward_context(ForwardContext(meta, kv, TorchAttentionBackend())):
        return model.compute_logits(model(input_ids, positions))


def test_logits_match_hf(checkpoint):
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model = load(checkpoint)
    vocab = hf.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    total = [p + q for p, q in zip(PROMPT_LENS, STEP2_LENS, strict=True)]
    seqs = [torch.randint(0, vocab, (n,), generator=generator) for n in total]
    with torch.no_grad():
        expected = [hf(s[None]).logits[0] for s in seqs]
    kv = kv_caches(hf.config)

    starts = [[0, 0, 0], PROMPT_LENS]
    for step, lens in enumerate([PROMPT_LENS, STEP2_LENS]):
        positions, meta = step_metadata(starts[step], lens)
        chunks = zip(seqs, starts[step], lens, strict=True)
        input_ids = torch.cat([s[a : a + n] for s, a, n in chunks])
        logits = run(model, kv, input_ids, positions, meta)
        spans = zip(expected, starts[step], lens, strict=True)
        want = torch.cat([e[a : a + n] for e, a, n in spans])
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4, msg=f"step {step}")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied and tied LM head
def test_pipeline_stages_match_whole_model(arch, tmp_path):
    path = make_hf_checkpoint(arch, tmp_path, num_hidden_layers=3)
    whole, first, last = load(path), load(path, (0, 1)), load(path, (1, 3))
    assert first.lm_head is None and last.model.embed_tokens is None
    hf_config = whole.config
    input_ids = torch.randint(0, hf_config.vocab_size, (sum(PROMPT_LENS),))
    positions, meta = step_metadata([0, 0, 0], PROMPT_LENS)

    want = run(whole, kv_caches(hf_config), input_ids, positions, meta)
    kv = kv_caches(hf_config)  # indexed by global layer, as each stage's attention is
    with torch.no_grad(), forward_context(ForwardContext(meta, kv, TorchAttentionBackend())):
        sent = first(input_ids, positions)
        assert isinstance(sent, IntermediateTensors)
        kept = IntermediateTensors(sent.hidden_states.clone(), sent.residual.clone())
        got = last.compute_logits(last(input_ids, positions, sent))
    torch.testing.assert_close(got, want)
    # a stage never writes into its inputs (on GPU: the runner's receive buffers)
    assert torch.equal(kept.hidden_states, sent.hidden_states)
    assert torch.equal(kept.residual, sent.residual)


def prefilled(arch, tmp_path, lens):
    """A random checkpoint of arch, HF's logits after each request's lens[i] + 1 tokens, and
    ostinato's model with the first lens[i] prefilled into a KV cache (the torch backend):
    (hf, model, kv, seqs, want), the decode step of each seq's last token left to the test."""
    checkpoint = make_hf_checkpoint(arch, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model = load(checkpoint)
    seqs = [torch.randint(0, hf.config.vocab_size, (n + 1,)) for n in lens]
    with torch.no_grad():
        want = torch.cat([hf(s[None]).logits[0, -1:] for s in seqs])
    kv = kv_caches(hf.config)
    positions, meta = step_metadata([0] * len(lens), lens)
    run(model, kv, torch.cat([s[:-1] for s in seqs]), positions, meta)
    return hf, model, kv, seqs, want


@pytest.mark.parametrize("prologue", [True, False], ids=["norm-in-kernel", "norm-first"])
@pytest.mark.parametrize("lens", [PROMPT_LENS[1:2], PROMPT_LENS], ids=["fma-1", "dot-3"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # + biases, + q/k norms
def test_decode_through_the_fused_projections_matches_hf(
    arch, lens, prologue, tmp_path, monkeypatch
):
    """A decode token per request where the small-batch kernels run (forced on the CPU,
    interpreted): the residual adds in the projections' epilogues, and the norms in their
    prologues or (where only the kernel without a norm pays) in a norm kernel before it,
    SiLU-and-mul still in gate|up's epilogue, give HF's logits; the prefill before it takes
    the unfused path, so both kinds share one stream."""
    hf, model, kv, seqs, want = prefilled(arch, tmp_path, lens)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    asked = []  # the layers' projections (the LM head would only slow the interpreter)

    def pays(x, w, normed=False):
        if w.shape[0] == hf.config.vocab_size:
            return False
        asked.append(normed)
        return prologue or not normed

    monkeypatch.setattr(linear_module, "gemv_pays", pays)
    separate_silu = []
    monkeypatch.setattr(linear_module, "silu_and_mul", lambda y: separate_silu.append(y))
    positions, meta = step_metadata(lens, [1] * len(lens))
    got = run(model, kv, torch.cat([s[-1:] for s in seqs]), positions, meta)
    # asked with their prologue: qkv and gate|up after a norm, o and down before an add; and
    # without one, qkv and gate|up again after the norm kernel
    layers = hf.config.num_hidden_layers
    assert asked.count(True) == 2 * layers
    assert asked.count(False) == (2 if prologue else 4) * layers
    assert not separate_silu
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("breaks", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # + q/k norms
def test_a_decode_step_rotates_in_its_attention_launch(arch, breaks, tmp_path, monkeypatch):
    """A decode step through the Triton backend (interpreted on the CPU): the attention launch
    rotates q and k (after Qwen3's norms) and stores k and v itself, no RoPE + store launch,
    and the logits are HF's. Where the attention call is to be a break between captured
    segments (a PIECEWISE capture's warm-up), RoPE + store stay in the layer and the launch
    takes no rotation: the same logits."""
    from ostinato.attention.triton_backend import TritonAttentionBackend
    from ostinato.graphs.breakable import warm_up_for
    from ostinato.layers import rotary as rotary_module

    lens = PROMPT_LENS
    hf, model, kv, seqs, want = prefilled(arch, tmp_path, lens)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    separate = []  # the layers' own RoPE + store launches
    rope_and_store = rotary_module.rope_and_store
    monkeypatch.setattr(
        rotary_module,
        "rope_and_store",
        lambda *a, **k: separate.append(1) or rope_and_store(*a, **k),
    )
    positions, meta = step_metadata(lens, [1] * len(lens))
    backend = TritonAttentionBackend()
    with torch.no_grad(), forward_context(ForwardContext(meta, kv, backend)) as ctx:
        assert ctx.attention.rotates
        with warm_up_for(breaks):
            got = model.compute_logits(model(torch.cat([s[-1:] for s in seqs]), positions))
    assert len(separate) == (hf.config.num_hidden_layers if breaks else 0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_projection_decides_its_fusion_once_per_input_kind(monkeypatch):
    """Linear.plan asks gemv_pays once per input shape and dtype (every eager step asks it
    once a projection), and still follows the FUSE switch and a block-wise FP8 weight."""
    asked = []
    monkeypatch.setattr(
        linear_module, "gemv_pays", lambda x, w, n: not asked.append(x.shape) and x.dtype == w.dtype
    )
    proj = linear_module.Linear(8, 4)
    one, two = torch.zeros(1, 8), torch.zeros(2, 8)
    assert proj.plan(one) and proj.plan(one) and proj.plan(two)
    assert asked == [(1, 8), (2, 8)]
    half = one.to(torch.bfloat16)
    assert proj.plan(half) is None and proj.plan(half) is None and len(asked) == 3
    monkeypatch.setattr(linear_module, "FUSE", False)
    assert proj.plan(one) is None
    monkeypatch.setattr(linear_module, "FUSE", True)
    assert proj.plan(one)
    block_wise = linear_module.Linear(8, 4)
    block_wise.block = (128, 128)  # a block-wise FP8 checkpoint's weights: fp8.py's kernel
    assert block_wise.plan(one) is None and len(asked) == 3


def test_a_projection_plan_follows_the_input_layout_and_a_new_weight(monkeypatch):
    """Linear.plan keeps one launch per kind of input and weight: a strided input (another
    row stride) and a replaced weight of another layout each get their own, checked against
    float64 math (two rows: the tl.dot kernel, which reads both row strides)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(linear_module, "gemv_pays", lambda x, w, n: x.dtype == w.dtype)
    proj = linear_module.Linear(16, 32)
    proj.weight.data.copy_(torch.randn(32, 16))
    residual = torch.randn(2, 32)

    def check(x: torch.Tensor) -> None:
        got, rest = linear_module.residual_projection(proj, x, residual)
        want = x.double() @ proj.weight.double().T + residual.double()
        assert rest is None
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)

    check(torch.randn(2, 16))
    check(torch.randn(2, 48)[:, 16:32])  # rows 48 apart
    proj.weight = torch.nn.Parameter(torch.randn(32, 64)[:, 8:24], requires_grad=False)
    check(torch.randn(2, 16))


def test_a_norm_first_plan_serves_contiguous_inputs_only(monkeypatch):
    """Where the kernel takes a normed gate|up only without its prologue, the norm kernel runs
    first, then the kernel with SiLU in its epilogue, from a plan made for x's layout: a
    strided x, whose norm comes out contiguous, keeps the unfused path (its own SiLU kernel).
    Both equal float64 math, and so do calls with a residual, added first (where the
    projection before it could not add it: with tensor parallelism, o and down), norm first
    and in the kernel's prologue."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(linear_module, "gemv_pays", lambda x, w, normed=False: not normed)
    separate_silu = []
    silu_and_mul = linear_module.silu_and_mul
    monkeypatch.setattr(
        linear_module, "silu_and_mul", lambda y: separate_silu.append(y) or silu_and_mul(y)
    )
    proj, norm = linear_module.Linear(16, 64), RMSNorm(16, 1e-6)
    proj.weight.data.copy_(torch.randn(64, 16))
    norm.weight.data.copy_(torch.rand(16) + 0.5)

    def check(x: torch.Tensor, separate: int, residual: torch.Tensor | None = None) -> None:
        xd = x.double() if residual is None else x.double() + residual.double()
        got, stream = linear_module.normed_projection(proj, norm, x, residual, silu=True)
        normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
        gate, up = (normed @ proj.weight.double().T).chunk(2, -1)
        torch.testing.assert_close(got.double(), F.silu(gate) * up, atol=1e-4, rtol=1e-4)
        assert stream is x if residual is None else torch.allclose(stream.double(), xd)
        assert len(separate_silu) == separate

    check(torch.randn(2, 16), 0)
    check(torch.randn(2, 48)[:, 16:32], 1)  # rows 48 apart
    check(torch.randn(2, 16), 1, residual=torch.randn(2, 16))
    monkeypatch.setattr(linear_module, "gemv_pays", lambda x, w, normed=False: True)
    check(torch.randn(1, 16), 1, residual=torch.randn(1, 16))  # the add + norm in the prologue


def test_the_kernel_adds_the_bias_before_the_residual(monkeypatch):
    """project and residual_projection where the small-batch kernel runs (forced on the CPU,
    interpreted) with a bias: x @ w.T + b, then + the residual, as float64 math; a residual of
    another layout (rows 24 apart) gets a plan of its own."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(linear_module, "gemv_pays", lambda x, w, normed=False: True)
    proj = linear_module.Linear(16, 8, bias=True)
    proj.weight.data.copy_(torch.randn(8, 16))
    proj.bias.data.copy_(torch.randn(8))
    for rows in (1, 3):
        x = torch.randn(rows, 16)
        want = x.double() @ proj.weight.double().T + proj.bias.double()
        got = linear_module.project(x, proj.weight, proj.bias)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
        for residual in (torch.randn(rows, 8), torch.randn(rows, 24)[:, 8:16]):
            hidden, rest = linear_module.residual_projection(proj, x, residual)
            assert rest is None
            want_sum = want + residual.double()
            torch.testing.assert_close(hidden.double(), want_sum, atol=1e-4, rtol=1e-4)


def test_an_fp8_projection_takes_the_fused_kernel_with_its_scale(monkeypatch):
    """FP8 at load (a scale a row): at one row the projections plan the small-batch kernel
    with their own scales bound (the add + norm and SiLU of a normed gate|up, a residual
    epilogue), equal to fp8_linear's unfused sequence; quantising anew (a new weight) plans
    anew."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(linear_module, "gemv_pays", lambda x, w, normed=False: x.shape[0] == 1)
    gate_up, down, norm = (
        linear_module.Linear(16, 64), linear_module.Linear(32, 16), RMSNorm(16, 1e-6)
    )  # fmt: skip
    norm.weight.data.copy_(torch.rand(16) + 0.5)
    for proj in (gate_up, down):
        proj.weight.data.copy_(torch.randn(proj.weight.shape))
        proj.quantize_at_load = True
        proj.finish_loading()
        assert proj.fp8 and proj.weight.dtype == torch.float8_e4m3fn
    x, residual = torch.randn(1, 16), torch.randn(1, 16)
    act, stream = linear_module.normed_projection(gate_up, norm, x, residual, silu=True)
    hidden, rest = linear_module.residual_projection(down, act, stream)
    assert gate_up.plan(x, norm, residual, True) is not None and rest is None
    s = x + residual
    want_act = linear_module.silu_and_mul(gate_up(norm(s)))
    torch.testing.assert_close(stream, s)
    torch.testing.assert_close(act, want_act, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, down(act) + s, atol=1e-5, rtol=1e-5)
    down.fp8 = False
    down.weight = torch.nn.Parameter(torch.randn(16, 32), requires_grad=False)
    down.finish_loading()  # a new FP8 weight and scale: the plan bound to the old scale goes
    hidden, _ = linear_module.residual_projection(down, act, stream)
    torch.testing.assert_close(hidden, down(act) + s, atol=1e-5, rtol=1e-5)
    # where the kernel refused the norm in its prologue: the norm kernel, then the plain plan
    monkeypatch.setattr(linear_module, "gemv_pays", lambda x, w, normed=False: not normed)
    gate_up._plans = (None, None, {})
    act, _ = linear_module.normed_projection(gate_up, norm, x, residual, silu=True)
    torch.testing.assert_close(act, want_act, atol=1e-5, rtol=1e-5)


def fp8_projection(
    in_features: int, out_features: int, block, g: torch.Generator, bias: bool = False,
    kind: type[linear_module.Linear] = linear_module.Linear,
) -> linear_module.Linear:  # fmt: skip
    """A Linear (or kind) of random FP8 weights: block-wise with random scales where block is
    given, else quantised at load (a scale a row); its bias in bfloat16."""
    with building(QuantSpec("fp8", block) if block else None):
        proj = kind(in_features, out_features, bias=bias)
    if block:
        w = torch.randn(out_features, in_features, generator=g).to(torch.float8_e4m3fn)
        proj.weight.data.copy_(w)
        scales = proj.weight_scale_inv.shape
        proj.weight_scale_inv.data.copy_(torch.rand(scales, generator=g) + 0.5)
    else:
        proj.weight.data.copy_(torch.randn(out_features, in_features, generator=g))
        proj.quantize_at_load = True
        proj.finish_loading()
    if bias:
        proj.bias.data = torch.randn(out_features, generator=g).bfloat16()
    return proj


def bf16_norm(n: int, g: torch.Generator) -> RMSNorm:
    norm = RMSNorm(n, 1e-6)
    norm.weight.data.copy_(torch.rand(n, generator=g) + 0.5)
    return norm.bfloat16()


@pytest.mark.parametrize("block", [None, (64, 64), (16, 16)])
def test_an_fp8_normed_projection_of_a_few_rows_takes_x_quantised_by_its_norm(monkeypatch, block):
    """FP8 weights (a scale a row; block-wise, whose groups are 64 wide) at 2-32 rows: a
    normed projection plans the norm kernel quantising its output, then fp8.py's kernel on
    that FP8 x (_fp8_norm_first), and gives every bit of the unfused sequence (the norm
    kernel, fp8_linear, SiLU-and-mul): with a bias, with SiLU, with a residual (the stream
    added in place) and without one (the stream is x). Blocks 16 wide (groups narrower than
    the FP8 MMA's K) and float32 x keep the unfused path."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(3)
    proj, norm = fp8_projection(256, 192, block, g, bias=True), bf16_norm(256, g)
    for rows, silu, with_residual in ((3, True, True), (17, False, False), (2, False, True)):
        x = torch.randn(rows, 256, generator=g).bfloat16()
        residual = torch.randn(rows, 256, generator=g).bfloat16() if with_residual else None
        plan = proj.plan(x, norm, residual, silu)
        if block == (16, 16):
            assert plan is None
        else:
            assert plan.func is linear_module._fp8_norm_first
        stream = None if residual is None else residual.clone()
        normed, want_stream = norm.stream(x.clone(), stream)
        want = proj(normed)
        want = linear_module.silu_and_mul(want) if silu else want
        residual_in = None if residual is None else residual.clone()
        got, got_stream = linear_module.normed_projection(proj, norm, x, residual_in, silu)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(got_stream, want_stream, rtol=0, atol=0)
        if residual is not None:
            assert got_stream is residual_in  # added in place, as the norm kernel adds
    assert proj.plan(torch.randn(3, 256), RMSNorm(256, 1e-6), None) is None  # float32


@pytest.mark.parametrize("block, rows", [(None, 3), ((128, 128), 17)])
def test_an_fp8_split_is_left_unsummed_only_where_the_next_norm_kernel_sums_it(
    monkeypatch, block, rows
):
    """An FP8 residual projection whose launch splits K over no more tiles than rows hands on
    its SplitSum (the scale a row, or block-wise scales, applied when it settles): an FP8
    normed projection after it sums it in its norm kernel, settling nothing, with a residual
    or without one (the stream is then the settled output); any other plan settles it first.
    Each gives every bit of the summed path. No SplitSum from a bfloat16 weight, a bias,
    float32 x, more rows than the FP8 dot takes, or a projection split over tensor ranks."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(rows)
    k, n = (2100, 161) if block is None else (1152, 130)
    proj, norm = fp8_projection(k, n, block, g), bf16_norm(n, g)
    after = {"fp8": fp8_projection(n, 64, None, g), "bf16": linear_module.Linear(n, 64)}
    after["bf16"].weight.data = torch.randn(64, n, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    residual = torch.randn(rows, n, generator=g).bfloat16()
    summed = proj(x)
    settle, settled = SplitSum.settle, []
    monkeypatch.setattr(SplitSum, "settle", lambda self: settled.append(1) or settle(self))
    for name, nxt in after.items():
        for stream_in in (residual, None):
            want = linear_module.normed_projection(
                nxt, norm, summed.clone(), None if stream_in is None else stream_in.clone()
            )
            split, stream = linear_module.residual_projection(proj, x, stream_in)
            assert isinstance(split, SplitSum) and stream is stream_in
            settled.clear()
            stream = None if stream is None else stream.clone()
            got = linear_module.normed_projection(nxt, norm, split, stream)
            assert len(settled) == (name == "bf16" or stream_in is None)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert isinstance(split, SplitSum)
    torch.testing.assert_close(split.settle(), summed, rtol=0, atol=0)

    assert after["bf16"].unsummed(torch.randn(rows, n, generator=g).bfloat16()) is None
    assert fp8_projection(k, n, block, g, bias=True).unsummed(x) is None
    assert proj.unsummed(x.float()) is None
    assert proj.unsummed(torch.randn(33, k, generator=g).bfloat16()) is None
    row_parallel = fp8_projection(k, n, block, g, kind=linear_module.RowParallelLinear)
    assert isinstance(row_parallel.unsummed(x), SplitSum)
    row_parallel.tp = SimpleNamespace(size=2)
    assert row_parallel.unsummed(x) is None


def test_fp8_splits_leave_their_sum_to_the_next_norm_bit_for_bit(tmp_path, monkeypatch):
    """FP8 weights at the FP8 dot's rows: o and down, whose launches split K, hand their
    partials on unsummed (Linear.unsummed's SplitSum); the next norm kernel sums them, and
    only the final norm and a pipeline stage's hand-off settle them first. The step's logits and
    the stage's hand-off are every bit those of the summed path."""
    path = make_hf_checkpoint("llama", tmp_path, head_dim=256, intermediate_size=1024)
    config = EngineConfig(model=str(path), device="cpu", dtype="bfloat16", quantization="fp8")
    hf_config = load_hf_config(str(path))
    whole, first = load_model(config, hf_config), load_model(config, hf_config, (0, 1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    input_ids = torch.tensor([5, 17, 200])
    positions, meta = step_metadata([0, 0, 0], [1, 1, 1])

    def step(model):
        shape = (10, BLOCK, hf_config.num_key_value_heads, hf_config.head_dim)
        kv = [(torch.zeros(shape).bfloat16(), torch.zeros(shape).bfloat16())] * 3
        with torch.no_grad(), forward_context(ForwardContext(meta, kv, TorchAttentionBackend())):
            out = model(input_ids, positions)
            return out if first is model else model.compute_logits(out)

    unsummed, made = linear_module.Linear.unsummed, []
    monkeypatch.setattr(
        linear_module.Linear, "unsummed", lambda *a: made.append(unsummed(*a)) or made[-1]
    )
    settle, settled = SplitSum.settle, []
    monkeypatch.setattr(SplitSum, "settle", lambda self: settled.append(1) or settle(self))
    got, sent = step(whole), step(first)
    splits = [type(y) for y in made]
    assert splits.count(SplitSum) == 3 * hf_config.num_hidden_layers
    assert len(settled) == 2  # the final norm's, the stage's hand-off's: the norms sum the rest
    monkeypatch.setattr(linear_module.Linear, "unsummed", lambda *a: None)
    torch.testing.assert_close(got, step(whole), rtol=0, atol=0)
    want = step(first)
    assert isinstance(sent.hidden_states, torch.Tensor)
    torch.testing.assert_close(sent.hidden_states, want.hidden_states, rtol=0, atol=0)
    torch.testing.assert_close(sent.residual, want.residual, rtol=0, atol=0)


def test_pipeline_stages_hand_on_the_fused_stream(tmp_path, monkeypatch):
    """Where the last projection of a stage added the residual itself, the stage sends the
    stream with a zero residual, and the next stage's sum is the same stream."""
    path = make_hf_checkpoint("qwen3", tmp_path, num_hidden_layers=2)
    whole, first, last = load(path), load(path, (0, 1)), load(path, (1, 2))
    vocab = whole.config.vocab_size
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(linear_module, "gemv_pays", lambda x, w, *_: w.shape[0] != vocab)
    input_ids = torch.randint(0, vocab, (1,))
    positions, meta = step_metadata([0], [1])
    want = run(whole, kv_caches(whole.config), input_ids, positions, meta)
    with (
        torch.no_grad(),
        forward_context(ForwardContext(meta, kv_caches(whole.config), TorchAttentionBackend())),
    ):
        sent = first(input_ids, positions)
        assert not sent.residual.any()
        got = last.compute_logits(last(input_ids, positions, sent))
    torch.testing.assert_close(got, want)
