"""On the GPU: the FP8 kernels (GEMV, tiled block GEMM, _scaled_mm) against float64 math, and FP8
models (at load and a block-wise checkpoint) in every graph mode against eager, checker on."""

import gc

import pytest
import torch
from helpers import make_hf_checkpoint
from oracle import MODES, engine, mixed_workload
from test_quantization import (  # noqa: F401 (fixture)
    float64_linear,
    fp8_pair,
    grouped_x,
    quantize_blocks,
)

from ostinato.kernels import fp8
from ostinato.kernels.fp8 import GEMV_ROWS, fp8_linear, quantize_rows, quantize_tokens
from ostinato.kernels.gemv import gemv, gemv_normed, gemv_pays
from ostinato.kernels.norm import fused_add_rms_norm, rms_norm_to_fp8
from ostinato.layers import linear as linear_module

pytestmark = pytest.mark.gpu


def weights(rows: int, n: int = 1024, k: int = 512, blockwise: bool = False):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.05
    q, scale = quantize_blocks(w) if blockwise else quantize_rows(w)
    return x, q, scale


@pytest.mark.parametrize("rows, k", [(1, 512), (1, 8192), (3, 512), (8, 4096), (16, 512),
                                     (32, 4096), (40, 512), (300, 512)])  # fmt: skip
@pytest.mark.parametrize("blockwise", [False, True])
def test_fp8_linear_equals_float64_math(rows, k, blockwise):
    """K = 4096 and 8192: the small-batch kernel splits K. 2-32 rows: x quantised per group
    of 128 columns where the FP8 dot takes them (FP8_DOT_ROWS), exactly as grouped_x writes
    it."""
    x, q, scale = weights(rows, k=k, blockwise=blockwise)
    block = (128, 128) if blockwise else None
    dot_rows = rows <= GEMV_ROWS and fp8.gemv_config(rows, 1024, k, block, 132).fp8_x
    xs = grouped_x(x.bfloat16()) if dot_rows else x.bfloat16()
    want = float64_linear(xs, q, scale, 128 if blockwise else None)
    got = fp8_linear(x.bfloat16().cuda(), q.cuda(), scale.cuda(), block=block).double().cpu()
    size = want.abs().max().item()
    if blockwise or rows <= GEMV_ROWS:  # within bfloat16 rounding of the output
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * size)
    else:  # _scaled_mm: activations rounded to FP8 per token as well
        torch.testing.assert_close(got, want, rtol=0.1, atol=0.03 * size)
        cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
        assert cos > 0.998


def test_fp8_gemv_widens_every_fp8_value_exactly(monkeypatch):
    """Weight row n holds every finite FP8 byte, rotated by n; x picks columns 0..15, the
    scales are 1: y[m, n] is byte (n + m) % 256 as a value, which bfloat16 holds exactly (the
    bit moves of _bf16_from_fp8 on the weight-only tl.dot's path, subnormals included)."""
    monkeypatch.setattr(fp8, "FP8_DOT_ROWS", 0)
    codes = (torch.arange(256)[:, None] + torch.arange(256)[None, :]) % 256
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaN bytes
    q = codes.to(torch.uint8).view(torch.float8_e4m3fn).cuda()
    x = torch.eye(16, 256, dtype=torch.bfloat16, device="cuda")
    y = fp8_linear(x, q, torch.ones(256, 1, device="cuda"))
    assert torch.equal(y.float(), q[:, :16].T.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_token_fp8_activations_in_one_kernel_equal_their_definition(dtype):
    """The hardware's conversion and the quotient by the reciprocal and one correction
    (float32: full mantissas) as torch rounds them."""
    x = (torch.randn(5, 14336) * torch.logspace(-3, 2, 5)[:, None]).to(dtype)
    q, scale = quantize_tokens(x.cuda())
    want_scale = x.float().abs().amax(1, keepdim=True) / 448.0
    torch.testing.assert_close(scale.cpu(), want_scale, rtol=0, atol=0)
    want = (x.float() / want_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    torch.testing.assert_close(q.float().cpu(), want.float(), rtol=0, atol=0)


LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate|up": (28672, 4096),
            "down": (4096, 14336)}  # fmt: skip


@pytest.mark.parametrize("name", LLAMA_8B)
def test_fp8_dot_rows_at_llama_shapes_replay_in_a_graph_as_float64_math(name, monkeypatch):
    """llama-3.1-8b's projections at 8, 16 and 32 rows (the FP8 dot at every row count it
    serves), per-row and block-wise scales, the FP8 x FP8 dot in its chosen launch, captured
    in a CUDA graph and replayed: x quantised per group of 128 columns (grouped_x) times the
    dequantised weights, in float64."""
    monkeypatch.setattr(fp8, "FP8_DOT_ROWS", fp8.GEMV_ROWS)
    n, k = LLAMA_8B[name]
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.02
    for blockwise in (False, True):
        q, scale = quantize_blocks(w) if blockwise else quantize_rows(w)
        block = (128, 128) if blockwise else None
        if blockwise:
            expanded = scale.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
        else:
            expanded = scale.double()
        weight = (q.double().cuda() * expanded[:, :k].cuda()).T
        q, scale = q.cuda(), scale.cuda()
        for rows in (8, 16, 32):
            assert fp8.gemv_config(rows, n, k, block, 132).fp8_x
            x = torch.randn(rows, k, generator=g).bfloat16().cuda()
            want = grouped_x(x.cpu()).cuda() @ weight
            fp8_linear(x, q, scale, block=block)  # compiles, and a split's counts, outside
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fp8_linear(x, q, scale, block=block)
            size = want.abs().max().item()
            for _ in range(2):
                out.zero_()
                graph.replay()
                torch.testing.assert_close(out.double(), want, rtol=2**-7, atol=2**-7 * size)


@pytest.mark.parametrize("name", ["qkv", "gate|up"])
def test_the_norm_kernels_fp8_x_gives_the_loops_bits_at_llama_shapes_in_a_graph(name):
    """llama-3.1-8b's normed projections (q|k|v, gate|up) at 8, 16 and 32 rows, per-row and
    block-wise scales: the add + norm kernel quantising its output (rms_norm_to_fp8) and the
    FP8 dot on that FP8 x, captured in a CUDA graph and replayed, give every bit of the fused
    add + norm kernel followed by the FP8 dot quantising in its loop; the residual streams
    equal too."""
    n, k = LLAMA_8B[name]
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g) * 0.02
    norm_weight = (torch.rand(k, generator=g) + 0.5).bfloat16().cuda()
    for blockwise in (False, True):
        q, scale = quantize_blocks(w) if blockwise else quantize_rows(w)
        block = (128, 128) if blockwise else None
        q, scale = q.cuda(), scale.cuda()
        for rows in (8, 16, 32):
            assert fp8.fp8_x_pays(rows, torch.bfloat16, block)
            x = torch.randn(rows, k, generator=g).bfloat16().cuda()
            residual = torch.randn(rows, k, generator=g).bfloat16().cuda()
            normed, want_stream = x.clone(), residual.clone()
            fused_add_rms_norm(normed, want_stream, norm_weight, 1e-5)
            want = fp8_linear(normed, q, scale, block=block)
            stream = residual.clone()
            args = (x, stream, norm_weight, q, scale, block)
            normed_fp8_projection(*args)  # compiles, and a split's counts, outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = normed_fp8_projection(*args)
            for _ in range(2):
                stream.copy_(residual)
                out.zero_()
                graph.replay()
                torch.testing.assert_close(out, want, rtol=0, atol=0)
                torch.testing.assert_close(stream, want_stream, rtol=0, atol=0)


def normed_fp8_projection(x, stream, norm_weight, q, scale, block):
    """stream += x, then the norm kernel's FP8 x through the FP8 dot (as _fp8_norm_first)."""
    xq, xs = rms_norm_to_fp8(x, stream, norm_weight, 1e-5, fp8.x_group(block))
    return fp8.fp8_gemv(xq, q, scale, block, x_scales=xs, dtype=x.dtype)


@pytest.mark.parametrize("name", ["o", "down"])
def test_an_unsummed_split_gives_the_next_norms_bits_at_llama_shapes_in_a_graph(name):
    """llama-3.1-8b's o and down (the residual projections, whose K the FP8 dot splits) at 32
    rows (at 8 and 16, fewer than their tiles, the kernel sums), per-row and block-wise
    scales: the projection left unsummed and the next norm kernel summing it (Linear.unsummed,
    then _fp8_norm_first's rms_norm_to_fp8), captured in a CUDA graph and replayed, give every
    FP8 byte and scale and the residual stream of the summed projection followed by that
    norm; and settle() gives the projection's own bits."""
    n, k = LLAMA_8B[name]
    g = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=g) * 0.02
    norm_weight = (torch.rand(n, generator=g) + 0.5).bfloat16().cuda()
    for blockwise in (False, True):
        q, scale = quantize_blocks(w) if blockwise else quantize_rows(w)
        block = (128, 128) if blockwise else None
        q, scale = q.cuda(), scale.cuda()
        for rows in (8, 16, 32):
            x = torch.randn(rows, k, generator=g).bfloat16().cuda()
            residual = torch.randn(rows, n, generator=g).bfloat16().cuda()
            summed = fp8_linear(x, q, scale, block=block)
            want_stream = residual.clone()
            want_q, want_s = rms_norm_to_fp8(summed, want_stream, norm_weight, 1e-5, 128)
            split = fp8.fp8_gemv(x, q, scale, block, defer=True)  # compiles, outside
            if rows < 32:  # fewer rows than o's and down's 32 tiles: summed in the kernel
                torch.testing.assert_close(split, summed, rtol=0, atol=0)
                continue
            assert isinstance(split, fp8.SplitSum) and len(split.parts) > 1
            stream = residual.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                split = fp8.fp8_gemv(x, q, scale, block, defer=True)
                got_q, got_s = rms_norm_to_fp8(split, stream, norm_weight, 1e-5, 128)
            for _ in range(2):
                stream.copy_(residual)
                got_q.zero_()
                graph.replay()
                assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
                torch.testing.assert_close(got_s, want_s, rtol=0, atol=0)
                torch.testing.assert_close(stream, want_stream, rtol=0, atol=0)
            torch.testing.assert_close(split.settle(), summed, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_one_row_kernel_widens_every_value_exactly(dtype):
    """The fused one-row kernel on FP8 weights: weight row n holds every finite FP8 byte,
    rotated by n; x picks column 0 and the scales are 1, so y[n] is byte n as a value
    (bfloat16 holds every one): subnormals included."""
    codes = (torch.arange(256)[:, None] + torch.arange(256)[None, :]) % 256
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaN bytes
    q = codes.to(torch.uint8).view(torch.float8_e4m3fn).cuda()
    x = torch.zeros(1, 256, dtype=dtype, device="cuda")
    x[0, 0] = 1.0
    assert gemv_pays(x, q) and not gemv_pays(x.expand(2, 256), q)
    y = gemv(x, q, scale=torch.ones(256, 1, device="cuda"))
    assert torch.equal(y[0].float(), q[:, 0].float())


def _rounded_norm(s, norm_w):
    """rms_norm in float64, rounded to bfloat16 as the kernel's prologue stores it."""
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.double()
    return normed.bfloat16().double()


def test_fused_fp8_one_row_at_llama_shapes_replays_as_float64_math():
    """llama-3.1-8b's FP8 projections (a scale a row) at one row, each with the fusion the
    decode step gives it (qkv and gate|up with the add + norm in their prologue, gate|up's
    SiLU, o and down adding the residual), captured in a CUDA graph and replayed, against
    float64 math on the dequantised weights within bfloat16 rounding."""
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(1, 4096, generator=g).bfloat16().cuda()
    residual = torch.randn(1, 4096, generator=g).bfloat16().cuda()
    norm_w = (torch.rand(4096, generator=g) + 0.5).bfloat16().cuda()
    weights = {}
    for name, (n, k) in LLAMA_8B.items():
        q, scale = quantize_rows(torch.randn(n, k, generator=g) * 0.02)
        weights[name] = (q.cuda(), scale.cuda(), q.double().cuda() * scale.double().cuda())
    act_in = torch.randn(1, 14336, generator=g).bfloat16().cuda()

    def step():
        qkv, stream = gemv_normed(hidden, residual, norm_w, 1e-6, weights["qkv"][0],
                                  scale=weights["qkv"][1])  # fmt: skip
        act, _ = gemv_normed(hidden, residual, norm_w, 1e-6, weights["gate|up"][0], None,
                             True, scale=weights["gate|up"][1])  # fmt: skip
        o = gemv(hidden, weights["o"][0], add=residual, scale=weights["o"][1])
        down = gemv(act_in, weights["down"][0], add=residual, scale=weights["down"][1])
        return qkv, stream, act, o, down

    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    s = hidden.double() + residual.double()
    normed = _rounded_norm(s, norm_w)
    gate, up = (normed @ weights["gate|up"][2].T).chunk(2, dim=-1)
    wants = (
        normed @ weights["qkv"][2].T,
        s,
        torch.nn.functional.silu(gate.bfloat16().double()) * up.bfloat16().double(),
        hidden.double() @ weights["o"][2].T + residual.double(),
        act_in.double() @ weights["down"][2].T + residual.double(),
    )
    for _ in range(2):
        for out in outs:
            out.zero_()
        graph.replay()
        for out, want in zip(outs, wants, strict=True):
            size = want.abs().max().item()
            torch.testing.assert_close(out.double(), want, rtol=2**-7, atol=2**-7 * size)


def test_fp8_linear_is_capturable_and_replays_equal():
    for rows, k, blockwise in ((1, 512, False), (1, 8192, False), (4, 512, True),
                               (32, 4096, False), (64, 512, False), (64, 512, True)):  # fmt: skip
        x, q, scale = (t.cuda() for t in weights(rows, k=k, blockwise=blockwise))
        x = x.bfloat16()
        block = (128, 128) if blockwise else None
        want = fp8_linear(x, q, scale, block=block)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fp8_linear(x, q, scale, block=block)
        for _ in range(3):  # split launches leave their counts at 0 for the next replay
            out.zero_()
            graph.replay()
            torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def every_mode_equals_eager(model, exact: bool = True, **kw):
    """Tokens equal eager's (exact) and the checker passes in every graph mode; bfloat16's
    padded batches may round differently, so there the checker alone judges."""
    torch.backends.cuda.matmul.allow_tf32 = False
    reference = mixed_workload(engine(model, "none", **kw))
    for mode in MODES[1:]:
        llm = engine(model, mode, check_graphs=1, **kw)
        tokens = mixed_workload(llm)  # raises if a graphed step's logits leave eager's
        assert tokens == reference or not exact, mode
        if mode in ("full", "full_decode_only", "full_and_piecewise"):
            assert llm.graph_report()["steps"]["full"] > 0
        del llm
        gc.collect()


def test_fp8_at_load_every_mode_passes_the_checker_in_bfloat16(checkpoint):
    """bfloat16: the GEMV, and _scaled_mm for the larger padded batches."""
    every_mode_equals_eager(checkpoint, exact=False, quantization="fp8", dtype="bfloat16")


def test_fp8_at_load_every_mode_equals_eager_in_float32(checkpoint):
    """float32, tokens equal: the fused one-row kernel on FP8 weights (the workload's last
    request decodes alone), fp8.py's kernel for the other small batches."""
    every_mode_equals_eager(checkpoint, quantization="fp8")


def test_fp8_fused_one_row_equals_the_unfused_kernels(checkpoint, monkeypatch):
    """Eager float32, FP8 at load: the fused paths (the one-row kernel with the norms, SiLU
    and residual adds) give the tokens of the unfused sequence (norm kernels, fp8.py's kernel,
    the SiLU kernel, the residual adds)."""
    monkeypatch.setattr(linear_module, "FUSE", False)
    unfused = mixed_workload(engine(checkpoint, "none", quantization="fp8"))
    gc.collect()
    monkeypatch.setattr(linear_module, "FUSE", True)
    assert mixed_workload(engine(checkpoint, "none", quantization="fp8")) == unfused


def test_block_wise_fp8_checkpoint_every_mode_matches_eager(fp8_pair):  # noqa: F811
    """float32, tokens equal: the GEMV and the tiled block GEMM."""
    every_mode_equals_eager(fp8_pair[0])
