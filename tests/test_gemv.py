"""The small-batch projection kernel (kernels/gemv.py) under TRITON_INTERPRET=1: one row by
FMAs, 2 rows and more by tl.dot (K split over programs where the interpreter's 4 SMs ask for it),
with every fusion, against float64 math written here; and the row limits the engine follows.
Every input lies among NaNs (helpers.nan_fenced; matrices with a gap after each row), so a read
outside a tensor turns the output NaN."""

import pytest
import torch
import torch.nn.functional as F
from helpers import close, nan_fenced

from ostinato.kernels import gemv as gemv_module
from ostinato.kernels.fp8 import quantize_rows
from ostinato.kernels.gemv import (
    dot_config,
    gemv,
    gemv_config,
    gemv_normed,
    gemv_normed_torch,
    gemv_pays,
    gemv_torch,
    rows_pay,
)
from ostinato.kernels.small_batch import GemvConfig


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)


def silu_64(y):
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def normed_64(s, norm_w, eps=1e-6):
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * norm_w.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 17, 32])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(rows, silu, bias, dtype):
    """x @ W.T (+ bias), and with silu the merged gate|up projection's silu(gate) * up, over
    a K that is no multiple of any chunk (the tl.dot rows split it in four) and an N no
    multiple of the columns per program; x a view with a row stride of its own."""
    k, n = 1100, 2 * 37
    x = nan_fenced(torch.randn(rows, k).to(dtype), k + 3)
    weight = nan_fenced((torch.randn(n, k) * 0.05).to(dtype), k + 1)
    b = nan_fenced((torch.randn(n) * 0.1).to(dtype)) if bias else None
    out = gemv(x, weight, b, silu_and_mul=silu)
    assert out.shape == (rows, n // 2 if silu else n)
    y = x.double() @ weight.double().T + (b.double() if bias else 0)
    close(out, silu_64(y) if silu else y, dtype, scale=5)
    close(out, gemv_torch(x, weight, b, silu), dtype, scale=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 17, 32])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemv_normed_is_norm_then_projection(rows, silu, with_residual, dtype):
    """The norm prologue (after the residual add when given) against the unfused sequence in
    float64: s = x + residual, y = rms_norm(s) @ W.T + b (then silu); the stream s comes back
    as a new tensor, x and residual untouched. K = 1100 spans three 512-wide chunks of one
    row, and four splits of the tl.dot rows (whose sums of squares are split with them). x
    is a view with a row stride of its own; the stream a new contiguous tensor."""
    k, n = 1100, 2 * 37
    x = nan_fenced(torch.randn(rows, k).to(dtype), k + 5)  # rows k + 5 apart
    residual = nan_fenced(torch.randn(rows, k).to(dtype)) if with_residual else None
    norm_w = nan_fenced((torch.rand(k) + 0.5).to(dtype))
    weight = nan_fenced((torch.randn(n, k) * 0.05).to(dtype), k + 1)
    b = nan_fenced((torch.randn(n) * 0.1).to(dtype))
    x_before = x.clone()
    out, stream = gemv_normed(x, residual, norm_w, 1e-6, weight, b, silu)
    assert torch.equal(x, x_before)
    s = x.double() + (residual.double() if with_residual else 0)
    if with_residual:
        assert stream.data_ptr() not in (x.data_ptr(), residual.data_ptr())
        close(stream, s, dtype)
    else:
        assert stream is x
    y = normed_64(s, norm_w) @ weight.double().T + b.double()
    y = silu_64(y) if silu else y
    assert out.shape == y.shape
    close(out, y, dtype, scale=5)
    expected, _ = gemv_normed_torch(x, residual, norm_w, 1e-6, weight, b, silu)
    close(out, expected, dtype, scale=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 17])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemv_normed_also_stores_the_normalised_input(rows, with_residual, dtype):
    """normed_out (a MoE block's router, whose experts read the norm too): the normalised
    rows come back third, as the norm kernel stores them (within a rounding of the dtype: the
    sums of squares run in another order), whole although the programs of other column tiles
    and K splits skip storing; the projection and stream are those of the call without it."""
    k, n = 1100, 130
    x = nan_fenced(torch.randn(rows, k).to(dtype), k + 5)
    residual = nan_fenced(torch.randn(rows, k).to(dtype)) if with_residual else None
    norm_w = nan_fenced((torch.rand(k) + 0.5).to(dtype))
    weight = nan_fenced((torch.randn(n, k) * 0.05).to(dtype))
    out, stream, normed = gemv_normed(x, residual, norm_w, 1e-6, weight, normed_out=True)
    plain, plain_stream = gemv_normed(x, residual, norm_w, 1e-6, weight)
    assert torch.equal(out, plain) and torch.equal(stream, plain_stream)
    assert normed.shape == (rows, k) and normed.is_contiguous()
    expected = normed_64(stream.double(), norm_w)
    close(normed, expected, dtype)
    twin = gemv_normed_torch(x, residual, norm_w, 1e-6, weight, normed_out=True)
    assert len(twin) == 3
    close(twin[2], expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 32])
@pytest.mark.parametrize("silu", [False, True])
def test_gemv_adds_the_residual_in_its_epilogue(rows, silu, dtype):
    """y = x @ W.T (+ silu) + residual into a new tensor, the residual only read; odd K and N
    (K = 333: one split)."""
    k, n = 333, 2 * 19
    x = nan_fenced(torch.randn(rows, k).to(dtype))
    weight = nan_fenced((torch.randn(n, k) * 0.05).to(dtype), k + 1)
    residual = nan_fenced(torch.randn(rows, n // 2 if silu else n).to(dtype))
    before = residual.clone()
    out = gemv(x, weight, silu_and_mul=silu, add=residual)
    assert torch.equal(residual, before) and out.data_ptr() != residual.data_ptr()
    y = x.double() @ weight.double().T
    close(out, (silu_64(y) if silu else y) + residual.double(), dtype, scale=5)
    close(out, gemv_torch(x, weight, None, silu, add=residual), dtype, scale=2)


@pytest.mark.parametrize(
    "rows, n_out, k, config",
    [
        (3, 45, 300, GemvConfig(16, 16, 32, 96, 4, 4, 4)),  # split in four, edges masked
        (20, 45, 300, GemvConfig(16, 16, 32, 320, 1, 4, 4)),  # two row blocks, no split
        (20, 48, 256, GemvConfig(16, 16, 32, 64, 4, 4, 4)),  # both; every tile whole (EVEN)
        (40, 32, 96, GemvConfig(32, 16, 32, 32, 3, 4, 4)),  # two blocks of 32 rows, 3 splits
        (3, 45, 300, GemvConfig(16, 16, 32, 96, 4, 4, 4, swap=True)),  # the same, swapped
        (40, 32, 96, GemvConfig(32, 16, 32, 32, 3, 4, 4, swap=True)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_dot_configurations_with_every_fusion(rows, n_out, k, config, dtype):
    """The tl.dot kernel in configurations a benchmark may ask for, all fusions at once: the
    fused add + norm with a bias and SiLU-and-mul (the stream stored over every split and row
    block), then a residual epilogue; twice, so the split counts are back at 0 after a call."""
    x = nan_fenced(torch.randn(rows, k).to(dtype))
    residual = nan_fenced(torch.randn(rows, k).to(dtype))
    norm_w = nan_fenced((torch.rand(k) + 0.5).to(dtype))
    gate_up = nan_fenced((torch.randn(2 * n_out, k) * 0.05).to(dtype), k + 1)
    b = nan_fenced((torch.randn(2 * n_out) * 0.1).to(dtype))
    down = nan_fenced((torch.randn(n_out, n_out) * 0.1).to(dtype), n_out + 1)
    add = nan_fenced(torch.randn(rows, n_out).to(dtype))
    s = x.double() + residual.double()
    act_64 = silu_64(normed_64(s, norm_w) @ gate_up.double().T + b.double())
    for _ in range(2):
        act, stream = gemv_normed(x, residual, norm_w, 1e-6, gate_up, b, True, config=config)
        close(stream, s, dtype)
        close(act, act_64, dtype, scale=5)
        out = gemv(act, down, add=add, config=config)
        close(out, act.double() @ down.double().T + add.double(), dtype, scale=5)


def test_gemv_config_splits_narrow_weights_only():
    """One row: FMAs over the whole K. More: tl.dot on 16 or 32 padded rows, K split where
    the weight's column tiles are too few for the SMs, in whole chunks covering K once."""
    one = gemv_config(1, 4096, 1024, 2, 132)
    assert one.rows == 1 and one.split == 1 and one.span == 1024
    for m, rows in ((2, 16), (16, 16), (17, 32), (32, 32)):
        assert gemv_config(m, 4096, 1024, 2, 132).rows == rows
    wide = gemv_config(8, 14336, 4096, 2, 132)  # llama-3.1-8b gate|up: 224 tiles of 64
    assert wide.split == 1 and wide.span == 4096
    narrow = gemv_config(8, 1024, 3072, 2, 132)  # qwen3-0.6b down: 16 tiles
    assert narrow.split > 1 and narrow.span % narrow.block_k == 0
    assert (narrow.split - 1) * narrow.span < 3072 <= narrow.split * narrow.span
    qkv = gemv_config(8, 6144, 4096, 2, 132)  # llama-3.1-8b: 96 tiles of 64 rows, 48 of 128
    assert dot_config(8, 6144, 4096, 128, 128, True, 2, 132).split > qkv.split > 1
    assert gemv_config(8, 1024, 3072, 4, 132).num_stages < narrow.num_stages  # float32
    # the product swapped where no norm prologue makes x in registers (DOT_TILE's docs)
    assert narrow.swap and not gemv_config(8, 1024, 3072, 2, 132, normed=True).swap


def test_engine_takes_the_kernel_up_to_the_row_limits(monkeypatch):
    """rows_pay follows ROW_LIMITS: the first entry holding the weight's size gives its rows,
    a weight larger than every entry takes none; one row only up to MAX_K columns and
    MAX_WEIGHT_ELEMENTS. As measured: llama-3.1-8b's gate|up and down take it at one row, and
    without a norm prologue (norm first) up to 32, as its o; qwen3-0.6b's qkv and gate|up and
    qwen3-30b-a3b's qkv one row."""
    assert rows_pay(1, 2 * 14336, 4096) and rows_pay(1, 4096, 14336)
    assert rows_pay(32, 2 * 14336, 4096) and rows_pay(32, 4096, 14336)
    assert not rows_pay(33, 4096, 14336) and not rows_pay(2, 4096, 14336, normed=True)
    assert rows_pay(1, 4096, 1024) and not rows_pay(2, 4096, 1024)
    assert not rows_pay(2, 5120, 2048) and rows_pay(2, 4096, 4096)  # a3b qkv; llama o
    assert not rows_pay(2, 2 * 3072, 1024) and not rows_pay(2, 2 * 3072, 1024, normed=True)
    # as measured: qwen3-0.6b's down (3M elements) at 32 rows without a norm, 8 with one
    assert rows_pay(32, 1024, 3072) and not rows_pay(33, 1024, 3072)
    assert rows_pay(8, 1024, 3072, normed=True) and not rows_pay(9, 1024, 3072, normed=True)
    for table, normed in (("ROW_LIMITS", True), ("PLAIN_ROW_LIMITS", False)):
        monkeypatch.setattr(gemv_module, table, ((1 << 20, 32), (1 << 24, 4)))
        assert rows_pay(32, 1024, 1024, normed) and not rows_pay(33, 1024, 1024, normed)
        assert rows_pay(4, 1024, 2048, normed) and not rows_pay(5, 1024, 2048, normed)
        assert not rows_pay(1, 4096, 8192, normed)  # over every entry
        monkeypatch.setattr(gemv_module, table, ((1 << 40, 8),))
        max_k, most = gemv_module.MAX_K, gemv_module.MAX_WEIGHT_ELEMENTS
        assert rows_pay(1, 1024, max_k, normed) and not rows_pay(1, 1024, max_k + 1, normed)
        assert rows_pay(2, 1024, max_k + 1, normed)  # MAX_K: one row only
        n = most // 4096
        assert rows_pay(1, n, 4096, normed) and not rows_pay(1, n + 1, 4096, normed)
        assert rows_pay(8, n + 1, 4096, normed)  # MAX_WEIGHT_ELEMENTS: one row only
        monkeypatch.setattr(gemv_module, table, ())
        assert not rows_pay(1, 64, 64, normed)


def test_gemv_is_for_cuda_tensors_only():
    w = torch.randn(32, 64)
    assert not gemv_pays(torch.randn(1, 64), w)  # CPU tensors keep F.linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_weights_at_one_row_with_every_fusion(dtype):
    """FP8 weights with a scale a row (--quantization fp8) through the one-row kernel: the
    fused add + norm with a bias and SiLU-and-mul, then a residual epilogue over a second FP8
    weight, against float64 math on the dequantised weights and the torch twin; odd K and N
    (chunks of 128: K spans three)."""
    k, n_out = 300, 45
    config = GemvConfig(1, 8, 128, 384, 1, 4, 1)
    x = nan_fenced(torch.randn(1, k).to(dtype))
    residual = nan_fenced(torch.randn(1, k).to(dtype))
    norm_w = nan_fenced((torch.rand(k) + 0.5).to(dtype))
    gate_up, gate_up_scale = quantize_rows(torch.randn(2 * n_out, k) * 0.05)
    gate_up = nan_fenced(gate_up, k + 1)
    b = nan_fenced((torch.randn(2 * n_out) * 0.1).to(dtype))
    down, down_scale = quantize_rows(torch.randn(n_out, n_out) * 0.1)
    down = nan_fenced(down)
    add = nan_fenced(torch.randn(1, n_out).to(dtype))
    s = x.double() + residual.double()
    w64 = gate_up.double() * gate_up_scale.double()
    act_64 = silu_64(normed_64(s, norm_w) @ w64.T + b.double())
    act, stream = gemv_normed(
        x, residual, norm_w, 1e-6, gate_up, b, True, config=config, scale=gate_up_scale
    )
    close(stream, s, dtype)
    close(act, act_64, dtype, scale=5)
    out = gemv(act, down, add=add, config=config, scale=down_scale)
    want = act.double() @ (down.double() * down_scale.double()).T + add.double()
    close(out, want, dtype, scale=5)
    close(gemv_torch(act, down, None, add=add, scale=down_scale), want, dtype, scale=5)


def test_fp8_weights_at_one_row_widen_every_value_exactly():
    """Weight row n holds every finite FP8 byte, rotated by n; x picks column 0 and the scales
    are 1: y[n] is byte n as a value, which float32 holds exactly, subnormals included."""
    codes = (torch.arange(256)[:, None] + torch.arange(256)[None, :]) % 256
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaN bytes
    q = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    x = torch.zeros(1, 256)
    x[0, 0] = 1.0
    y = gemv(x, q, scale=torch.ones(256, 1))
    assert torch.equal(y[0], q[:, 0].float())
