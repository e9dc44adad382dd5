"""Quantised checkpoints: what we cannot run is refused by name, never loaded as garbage; FP8
weights (block-wise checkpoints, and FP8 at load) against float64 math and dequantised twins."""

import json
import re

import pytest
import torch
from helpers import fence_intact, make_hf_checkpoint, nan_fenced
from oracle import oracle_prompts, run_ostinato

from ostinato import LLM
from ostinato.kernels import dispatch, fp8
from ostinato.kernels.fp8 import GEMV_ROWS, GemvConfig, fp8_gemv, fp8_linear, quantize_rows
from ostinato.kernels.norm import fused_add_rms_norm, rms_norm, rms_norm_to_fp8
from ostinato.loader import load_hf_config


def with_quantization(path, quantization_config: dict) -> str:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint("qwen3", tmp_path_factory.mktemp("q") / "q")


@pytest.mark.parametrize(
    "quantization_config, message",
    [
        ({"quant_method": "awq", "bits": 4}, "unsupported quantization 'awq'"),
        ({"quant_method": "gptq", "bits": 4}, "unsupported quantization 'gptq'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True},
         "unsupported quantization 'bitsandbytes'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"},
         "unsupported fp8 checkpoint: weight_block_size None"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
         "unsupported fp8 activation_scheme 'static'"),
    ],
)  # fmt: skip
def test_a_quantization_we_cannot_run_is_one_line_naming_it(
    checkpoint, tmp_path, quantization_config, message
):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(checkpoint, path)
    model = with_quantization(path, quantization_config)
    for load in (load_hf_config, lambda m: LLM(m, device="cpu")):
        with pytest.raises(ValueError, match=re.escape(message)) as e:
            load(model)
        assert "\n" not in str(e.value) and str(e.value).startswith(model)


# ---- FP8 ---------------------------------------------------------------------------------
def quantize_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The released format: FP8 weights, weight_scale_inv [ceil(N/b), ceil(K/b)], written
    here from the definition (w ~ fp8 * scale per block)."""
    n, k = w.shape
    scale = torch.empty(-(-n // block), -(-k // block))
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / scale[i, j]).to(
                torch.float8_e4m3fn
            )
    return q, scale


def dequantized(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = q.double()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block : (i + 1) * block, j * block : (j + 1) * block] *= scale[i, j]
    return out


def float64_linear(x, q, scale, block):
    """x @ (FP8 weight times its row's or block's scale).T in float64."""
    w = dequantized(q, scale, block) if block else q.double() * scale.double()
    return x.double() @ w.T


@pytest.mark.parametrize(
    "path, rows, blockwise",
    [("torch", 5, False), ("torch", 5, True), ("triton", 40, True)],  # the tiled block GEMM
)  # fmt: skip
def test_fp8_linear_equals_float64_math(monkeypatch, path, rows, blockwise):
    if path == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=g)
    w = torch.randn(160, 256, generator=g) * 0.05
    if blockwise:
        q, scale = quantize_blocks(w)
    else:
        q, scale = quantize_rows(w)
    # among NaNs, a gap after each row: a read past a row or the end turns the output NaN
    scale = nan_fenced(scale, scale.shape[1] + 1)
    block = (128, 128) if blockwise else None
    want = float64_linear(x, q, scale, 128 if blockwise else None)
    # the interpreter's tl.dot mishandles bfloat16: the GEMM's bfloat16 runs in tests/gpu
    dtypes = ((torch.float32, 1e-5),) + (() if path == "triton" else ((torch.bfloat16, 2**-7),))
    for dtype, tol in dtypes:
        got = fp8_linear(nan_fenced(x.to(dtype), 256 + 8), q, scale, block=block).double()
        exact = float64_linear(x.to(dtype), q, scale, 128 if blockwise else None)
        # within the rounding of the output dtype, relative to the output's size
        torch.testing.assert_close(got, exact, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize(
    "rows, n, k, block",
    [
        (1, 5, 5120, None),  # one row: FMAs; K split in two, every chunk whole
        (1, 20, 300, (16, 64)),  # block-wise, blocks cut at both edges
        (3, 161, 2100, None),  # tl.dot on 16 padded rows, K split in four, edges masked
        (3, 161, 1100, (128, 128)),
        (16, 256, 1024, None),  # every tile whole
        (17, 161, 1100, (128, 128)),  # 32 padded rows
        (17, 130, 520, (64, 32)),
    ],
)  # fmt: skip
def test_fp8_gemv_equals_float64_math(monkeypatch, rows, n, k, block):
    """The small-batch kernel (up to GEMV_ROWS rows) on FP8 weights of every magnitude
    (subnormals included) and random scales, one per row or per block, against x @ (w *
    scale).T in float64; x a view with a row stride of its own (NaNs between its rows). The
    tl.dot rows weight-only (FP8_DOT_ROWS 0: the bfloat16 dot on widened weights)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fp8, "FP8_DOT_ROWS", 0)
    assert rows <= GEMV_ROWS
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, k + 5, generator=g)[:, :k]
    q, scale, expanded = random_fp8_weights(n, k, block, g)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2**-7)):
        x = nan_fenced(x.to(dtype), k + 5)
        want = x.double() @ (q.double() * expanded).T
        got = fp8_linear(x, q, scale, block=block)
        assert got.dtype == dtype and got.shape == (rows, n)
        # within the output dtype's rounding, relative to the output's size
        size = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * size)
        again = fp8_linear(x, q, scale, block=block)  # a split leaves its counts at 0
        torch.testing.assert_close(again, got, rtol=0, atol=0)


def random_fp8_weights(n: int, k: int, block: tuple[int, int] | None, g: torch.Generator):
    """FP8 weights of every magnitude (2^-12 .. 2^8, subnormals included), random scales (one
    per row or per block), and the scales expanded to [n, k] in float64. The scales lie among
    NaNs (nan_fenced), a gap after each row, so a read past a row's last column (a chunk of K
    past the last scale column, say) or past the end turns the output NaN. (Not the weights:
    the interpreter reads FP8's NaN byte as 480, which a zero x hides.)"""
    magnitudes = 2.0 ** (torch.rand(n, k, generator=g) * 20 - 12)
    q = (torch.randn(n, k, generator=g) * magnitudes).clamp(-448, 448).to(torch.float8_e4m3fn)
    if block is None:
        scale = nan_fenced(torch.rand(n, 1, generator=g) + 0.5)
        return q, scale, scale.double()
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) + 0.5
    scale = nan_fenced(scale, scale.shape[1] + 1)
    expanded = scale.double().repeat_interleave(block[0], 0)[:n]
    return q, scale, expanded.repeat_interleave(block[1], 1)[:, :k]


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], float32 scales [M, ceil(K / group)]) as the FP8 dot rows
    quantise x, in torch: each group's scale its largest magnitude (at least 1e-12) over 448;
    x / scale clamped to +-448 and rounded to FP8."""
    m, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -k % group)).view(m, -1, group)
    scale = padded.abs().amax(2, keepdim=True).clamp(min=1e-12) / 448.0
    q = (padded / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(m, -1)[:, :k]
    return q, scale.view(m, -1)


def grouped_x(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """x [M, K] as the FP8 dot rows take it, in float64: each row in groups of `group`
    columns (the last one shorter), each group divided by its scale (its largest magnitude,
    at least 1e-12, over 448), clamped to +-448, rounded to FP8, times that scale."""
    out = torch.empty(x.shape, dtype=torch.float64)
    for j in range(0, x.shape[1], group):
        part = x[:, j : j + group].float()
        scale = part.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0
        q = (part / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[:, j : j + group] = q.double() * scale.double()
    return out


@pytest.mark.parametrize("span, split", [(256, 3), (512, 2), (1024, 1)])
def test_fp8_gemv_one_row_spans_past_k(monkeypatch, span, split):
    """One row, block-wise: a launch whose spans reach past K (520) has chunks with no weight
    columns; they add nothing and read no scale past the last column (the scales are
    fenced by NaNs)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(span)
    n, k, block = 130, 520, (64, 64)
    x = nan_fenced(torch.randn(1, k, generator=g))
    q, scale, expanded = random_fp8_weights(n, k, block, g)
    config = fp8.gemv_config(1, n, k, block, 4, torch.float32)._replace(span=span, split=split)
    got = fp8_gemv(x, q, scale, block, config)
    want = x.double() @ (q.double() * expanded).T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize(
    "rows, n, k, block, config",
    [
        (2, 161, 300, None, None),  # K not a multiple of the chunk, columns masked
        (16, 256, 1024, None, GemvConfig(16, 64, 256, 512, 2, 4, 4, True)),  # 2 groups a
        # chunk, split in two, every tile whole
        (17, 130, 1100, (128, 128), None),  # 32 padded rows, split in two
        (32, 161, 1100, None, GemvConfig(32, 64, 256, 512, 3, 4, 4, True)),  # the last chunk
        # half a group, half nothing
        (32, 130, 520, (64, 64), GemvConfig(32, 64, 128, 128, 5, 4, 4, True)),  # groups of 64
        (3, 130, 520, (64, 32), None),  # groups of 32, weight blocks cut at both edges
    ],
)  # fmt: skip
def test_fp8_dot_rows_equal_float64_math_of_x_quantised_per_group(
    monkeypatch, rows, n, k, block, config
):
    """2-32 rows of half-precision x (the FP8 dot, here at every row count it serves): x
    quantised per (row, 128 columns, or the scale block's width where narrower) to FP8 and
    multiplied by the FP8 weights, against that math in float64 (grouped_x); the bfloat16
    launch gemv_config chooses (with a bias), and float32 in a forced FP8 x launch, within
    float32 rounding."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fp8, "FP8_DOT_ROWS", fp8.GEMV_ROWS)
    g = torch.Generator().manual_seed(rows * n + k)
    x = nan_fenced(torch.randn(rows, k + 5, generator=g)[:, :k] * 3, k + 5)
    q, scale, expanded = random_fp8_weights(n, k, block, g)
    group = 128 if block is None else min(128, block[1])
    bias = nan_fenced(torch.randn(n, generator=g).bfloat16())
    assert fp8.gemv_config(rows, n, k, block, 4, torch.bfloat16).fp8_x
    got = fp8_linear(nan_fenced(x.bfloat16(), k + 5), q, scale, bias, block=block)
    want = grouped_x(x.bfloat16(), group) @ (q.double() * expanded).T + bias.double()
    size = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=2**-7 * size)
    config = config or fp8.gemv_config(rows, n, k, block, 4, torch.float32)._replace(fp8_x=True)
    for _ in range(2):  # a split leaves its counts at 0
        got = fp8_gemv(x, q, scale, block, config)
        want = grouped_x(x, group) @ (q.double() * expanded).T
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * size)


def test_fp8_dot_rows_scale_x_once_per_group_of_its_row(monkeypatch):
    """Groups of x 10^-3 .. 10^3 apart, in rows of their own magnitudes: one scale for a whole
    row would round the small groups away, and a scale applied twice or not at all would miss
    by its size; the kernel gives the per-group math (which differs from the per-row one)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(7)
    rows, n, k = 4, 64, 512
    magnitude = 10.0 ** torch.tensor([[-3, 0, 3, -1], [2, -2, 0, 1], [0, 0, 0, 0], [1, 3, -3, 2]])
    x = (torch.randn(rows, k, generator=g) * magnitude.repeat_interleave(128, 1)).bfloat16()
    q, scale, expanded = random_fp8_weights(n, k, None, g)
    w = (q.double() * expanded).T
    got = fp8_linear(x, q, scale).double()
    want = grouped_x(x) @ w
    per_row = grouped_x(x, k) @ w
    for a, b in ((got, want), (per_row, want)):
        error = ((a - b).abs() / b.abs().amax(1, keepdim=True)).max().item()
        assert (error < 2**-7) == (a is got), error


@pytest.mark.parametrize(
    "rows, n, group, add",
    [
        (3, 384, 128, True),  # three whole groups
        (5, 640, 128, True),  # the last group past the row's end (a block of 1,024)
        (2, 16, 128, False),  # a row shorter than a group: one group, no residual
        (4, 448, 64, True),  # a block-wise checkpoint's narrower groups, the last one short
    ],
)  # fmt: skip
def test_the_norm_kernel_quantises_what_it_would_store_as_the_fp8_dot_rows_do(
    monkeypatch, rows, n, group, add
):
    """rms_norm_to_fp8 (the norm before an FP8 projection of a few rows): the residual stream
    the fused add + norm leaves, and that kernel's normalised output quantised per group
    (quantize_groups, itself the float64 per-group math of grouped_x), every FP8 byte and
    scale exact; nothing written outside its outputs (x, the residual and the weight lie
    among NaNs)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(rows * n)
    scales = 10.0 ** torch.randint(-3, 3, (rows, 1), generator=g)  # rows of every magnitude
    x = (torch.randn(rows, n, generator=g) * scales).bfloat16()
    residual = (torch.randn(rows, n, generator=g) * scales).bfloat16()
    weight = (torch.rand(n, generator=g) + 0.5).bfloat16()
    want, stream = x.clone(), residual.clone()
    if add:
        fused_add_rms_norm(want, stream, weight, 1e-6)
    else:
        want = rms_norm(x, weight, 1e-6)
    want_q, want_s = quantize_groups(want, group)
    assert want_s.shape == (rows, -(-n // group))
    torch.testing.assert_close(want_q.double() * want_s.repeat_interleave(group, 1)[:, :n].double(),
                               grouped_x(want, group), rtol=0, atol=0)  # fmt: skip
    fenced_x, fenced_res = nan_fenced(x, n + 3), nan_fenced(residual, n + 3)
    q, s = rms_norm_to_fp8(fenced_x, fenced_res if add else None, nan_fenced(weight), 1e-6, group)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)
    torch.testing.assert_close(fenced_res, stream if add else residual, rtol=0, atol=0)
    torch.testing.assert_close(fenced_x, x, rtol=0, atol=0)  # x itself is only read
    assert fence_intact(fenced_res) and fence_intact(fenced_x)


@pytest.mark.parametrize(
    "rows, n, k, block, config",
    [
        (3, 161, 2100, None, None),  # gemv_config's launch: K split, the last group short
        (17, 130, 1100, (128, 128), None),  # 32 padded rows, block-wise
        (16, 161, 1100, None, GemvConfig(16, 64, 256, 512, 3, 4, 4, True)),  # a chunk's
        # second group starts past K
        (32, 130, 520, (64, 64), GemvConfig(32, 64, 128, 128, 5, 4, 4, True)),  # groups of 64
    ],
)  # fmt: skip
def test_fp8_dot_rows_take_x_quantised_before_them_as_they_quantise_it(
    monkeypatch, rows, n, k, block, config
):
    """fp8_gemv given x already quantised (FP8 and its group scales, as the norm kernel hands
    them over) gives every bit the kernel gives where it quantises x itself; x and its scales
    among NaNs (a scale past the last group read would turn the output NaN). A launch without
    the FP8 dot cannot take an FP8 x, and an FP8 x needs its output dtype named."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(rows * n + k)
    x = (torch.randn(rows, k, generator=g) * 3).bfloat16()
    w, scale, _ = random_fp8_weights(n, k, block, g)
    bias = torch.randn(n, generator=g).bfloat16()
    want = fp8_linear(x, w, scale, bias, block) if config is None else (
        fp8_gemv(x, w, scale, block, config)
    )  # fmt: skip
    q, s = quantize_groups(x, fp8.x_group(block))
    q, s = nan_fenced(q, k + 3), nan_fenced(s, s.shape[1] + 1)
    got = fp8_gemv(q, w, scale, block, config, x_scales=s, dtype=torch.bfloat16)
    if config is None:
        got += bias
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="output dtype"):
        fp8_gemv(q, w, scale, block, config, x_scales=s)
    weight_only = fp8.gemv_config(rows, n, k, block, 4)._replace(fp8_x=False)
    with pytest.raises(ValueError, match="FP8 x FP8 dot"):
        fp8_gemv(q, w, scale, block, weight_only, x_scales=s, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "rows, n, k, block, splits",
    [
        (3, 161, 2100, None, 4),  # a scale a row
        (17, 130, 1100, (128, 128), 2),  # block-wise: the partials scaled already
        (2, 161, 256, None, 1),  # no split: the output itself
        (3, 500, 2100, None, 1),  # split, but fewer rows than tiles: summed in the kernel
    ],
)  # fmt: skip
def test_an_unsummed_fp8_split_settles_and_normalises_to_the_kernels_bits(
    monkeypatch, rows, n, k, block, splits
):
    """fp8_gemv(defer=True) where the launch splits K over at most as many tiles as rows: a
    SplitSum, whose settle() gives every bit of the kernel's own output, and which the FP8
    norm kernel takes with a residual as it takes that output (every FP8 byte and scale, the
    stream added in place); without a residual it settles first and the stream is the
    settled output. Unsplit, or over more tiles than rows: the output."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(rows * n + k)
    x = (torch.randn(rows, k, generator=g) * 3).bfloat16()
    w, scale, _ = random_fp8_weights(n, k, block, g)
    want = fp8_gemv(x, w, scale, block)
    assert fp8.gemv_config(rows, n, k, block, 4).split > 1 or k < 1024
    split = fp8_gemv(x, w, scale, block, defer=True)
    if splits == 1:
        torch.testing.assert_close(split, want, rtol=0, atol=0)
        return
    assert isinstance(split, fp8.SplitSum) and len(split.parts) == splits
    assert (split.scale is None) == (block is not None)
    residual = torch.randn(rows, n, generator=g).bfloat16()
    weight = (torch.rand(n, generator=g) + 0.5).bfloat16()
    stream, want_stream = residual.clone(), residual.clone()
    q, s = rms_norm_to_fp8(split, stream, weight, 1e-6, 64)
    want_q, want_s = rms_norm_to_fp8(want.clone(), want_stream, weight, 1e-6, 64)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)
    torch.testing.assert_close(stream, want_stream, rtol=0, atol=0)
    q, s = rms_norm_to_fp8(split, None, weight, 1e-6, 64)
    want_q, want_s = rms_norm_to_fp8(want, None, weight, 1e-6, 64)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)
    torch.testing.assert_close(split.out, want, rtol=0, atol=0)
    split.out.zero_()
    torch.testing.assert_close(split.settle(), want, rtol=0, atol=0)


def test_deferred_partials_share_one_workspace_outside_the_graph_pools(monkeypatch):
    """Deferred splits take their partials from the device's one buffer (dispatch.
    deferred_parts), never a fresh tensor (under a graph, one from the pool that outlives the
    launch): two of them share its start; a larger one grows it and keeps the old buffer
    alive, and a smaller one after that reads the grown one's start."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch, "_deferred_parts", {})
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 2100, generator=g) * 3).bfloat16()
    sums = []
    for n in (161, 161, 170, 161):
        w, scale, _ = random_fp8_weights(n, 2100, None, g)
        sums.append(fp8_gemv(x, w, scale, defer=True))
        torch.testing.assert_close(sums[-1].settle(), fp8_gemv(x, w, scale), rtol=0, atol=0)
    held = dispatch._deferred_parts[torch.device("cpu")]
    assert [t.numel() for t in held] == [4 * 3 * 161, 4 * 3 * 170]
    starts = [s.parts.data_ptr() for s in sums]
    assert starts == [held[0].data_ptr()] * 2 + [held[1].data_ptr()] * 2


def test_fp8_activations_round_to_nearest_even_as_torch_does(monkeypatch):
    """quantize_tokens (the per-token activations of _scaled_mm) and the FP8 dot rows share
    the quantiser: float32 x of full mantissas at every magnitude, FP8 values, the midpoints
    between them (ties to even; carries into the next binade; subnormals) and their
    neighbours, whose scale is 1 or 3 (a quotient at a midpoint exactly), and quotients near
    the midpoints at a scale where a product by the reciprocal rounds them wrongly: torch's
    values."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(0)
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[values.isfinite() & (values >= 0)].sort().values
    middles = (values[1:] + values[:-1]) / 2
    near = torch.cat([values, middles, middles.nextafter(torch.tensor(1e9)),
                      middles.nextafter(torch.tensor(-1e9))])  # fmt: skip
    near = torch.cat([near, -near])
    rows = [near * 3, near, torch.randn(near.numel(), generator=g) * 1e-3]
    rows += [torch.randn(near.numel(), generator=g) * 10.0**e for e in (-20, 0, 20)]
    # a scale at which x times the rounded 1 / scale lands on the wrong side of 126 midpoints
    amax = torch.tensor([831.0363159179688])
    at = middles * (amax / 448)
    up, down = at.nextafter(torch.tensor(1e9)), at.nextafter(torch.tensor(-1e9))
    tricky = torch.cat([at, up, down, up.nextafter(up + 1), down.nextafter(down - 1), amax])
    rows.append(torch.nn.functional.pad(tricky, (0, near.numel() - tricky.numel())))
    x = torch.stack(rows)
    q, s = fp8.quantize_tokens(x)
    want_s = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)
    assert s[0].item() == 3 and s[1].item() == 1
    want = (x / want_s).clamp(-448, 448).to(torch.float8_e4m3fn)
    torch.testing.assert_close(q.float(), want.float(), rtol=0, atol=0)


def test_quantize_rows_keeps_each_row_within_fp8_rounding():
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]
    q, scale = quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    back = q.float() * scale
    assert ((back - w).abs() <= w.abs().amax(1, keepdim=True) * 2**-4).all()


LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    """A block-wise FP8 Qwen3 checkpoint and its dequantised float32 twin; every projection,
    and each of two tensor ranks' share of it, whole 128 x 128 blocks."""
    import shutil

    from safetensors.torch import load_file, save_file

    checkpoint = make_hf_checkpoint(
        "qwen3", tmp_path_factory.mktemp("q128") / "q", head_dim=128, hidden_size=256
    )
    tensors = load_file(checkpoint / "model.safetensors")
    fp8, twin = {}, {}
    for name, t in tensors.items():
        if any(f".{p}.weight" in name for p in LINEAR):
            q, scale = quantize_blocks(t)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            twin[name] = dequantized(q, scale).float()
        else:
            fp8[name] = twin[name] = t
    root = tmp_path_factory.mktemp("fp8")
    paths = []
    for label, content in (("fp8", fp8), ("twin", twin)):
        path = root / label
        shutil.copytree(checkpoint, path)
        save_file(content, path / "model.safetensors")
        paths.append(path)
    with_quantization(paths[0], {"quant_method": "fp8", "weight_block_size": [128, 128],
                                 "activation_scheme": "dynamic"})  # fmt: skip
    return paths


def test_block_wise_fp8_checkpoint_matches_its_dequantised_twin(fp8_pair):
    fp8, twin = fp8_pair
    prompts = oracle_prompts(300)
    llm, ours = run_ostinato(fp8, prompts, 8, device="cpu", dtype="float32")
    _, want = run_ostinato(twin, prompts, 8, device="cpu", dtype="float32")
    assert ours == want
    layer = llm.engine.executor.runner.model.model.layers["0"]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.self_attn.qkv_proj.weight_scale_inv.shape == (8, 2)  # 1024 x 256 weights
    assert layer.mlp.down_proj.weight_scale_inv.shape == (2, 2)


@pytest.mark.parametrize("tp", [2])
def test_block_wise_fp8_under_tensor_parallelism_generates_what_one_process_does(fp8_pair, tp):
    fp8, _ = fp8_pair
    prompts = oracle_prompts(300)[:3]
    llm, want = run_ostinato(fp8, prompts, 6, device="cpu", dtype="float32")
    got_llm, got = run_ostinato(
        fp8, prompts, 6, device="cpu", dtype="float32", tensor_parallel_size=tp
    )
    try:
        assert got == want
    finally:
        got_llm.engine.shutdown()


def test_quantization_fp8_at_load_equals_its_per_row_dequantised_twin(checkpoint, tmp_path):
    """Each row of each projection as FP8 times one float32 scale (its largest magnitude over
    448), written here into a float32 twin: greedy tokens equal."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(checkpoint / "model.safetensors")
    for name, t in tensors.items():
        if any(f".{p}.weight" in name for p in LINEAR):
            scale = t.abs().amax(1, keepdim=True) / 448.0
            tensors[name] = (t / scale).to(torch.float8_e4m3fn).float() * scale
    twin = tmp_path / "twin"
    shutil.copytree(checkpoint, twin)
    save_file(tensors, twin / "model.safetensors")
    prompts = oracle_prompts(300)
    llm, ours = run_ostinato(checkpoint, prompts, 8, device="cpu", dtype="float32",
                             quantization="fp8")  # fmt: skip
    _, want = run_ostinato(twin, prompts, 8, device="cpu", dtype="float32")
    assert ours == want
    mlp = llm.engine.executor.runner.model.model.layers["0"].mlp
    assert mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert mlp.gate_up_proj.weight_scale.shape == (512, 1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"quantization": "int4"}, "unknown quantization 'int4'"),
        ({"model": "random:tiny-moe", "quantization": "fp8"},
         "fp8 weights of a mixture-of-experts model are not supported yet"),
        ({"quantization": "fp8", "enable_lora": True}, "enable_lora does not work with fp8"),
    ],
)  # fmt: skip
def test_bad_quantization_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(**{"model": "tiny", "device": "cpu", **kwargs})
