"""x @ weight.T for the few rows of a decode batch, optionally fused with the RMSNorm before it,
SiLU-and-mul, and the residual add after it.

cuBLAS runs a small decode projection (a few MB of weights) as a latency-bound GEMM with few
thread blocks, at a third of the copy bandwidth, some as a split-K GEMM plus a reduction
kernel, and every op around it is a small kernel of its own. Here the weights stream through
one kernel, and what would be separate small kernels around it runs inside it:
- a norm prologue: the input rows are normalised in the kernel (the hidden size is small, the
  rows come from L2), adding the residual first when the norm is the fused add + norm; the
  programs of the first column tile store that sum, the residual stream the layer goes on with;
- SiLU-and-mul over a merged gate|up projection before storing;
- a residual epilogue: the output is the projection plus the residual stream, so the norm
  that follows reads one tensor.
One row: every program reads a few whole weight rows with all their loads in flight, FMAs and
a sum (_gemv_row_kernel); FP8 weights with a scale a row (--quantization fp8) too, widened in
registers and each row's sum scaled, so an FP8 decode step of one request gets the same fusions
(fp8.py's kernel serves their other small batches and block-wise checkpoints). From DOT_ROWS
rows: tl.dot on x padded to 16 or 32 rows, the tensor cores' smallest tile (_gemv_dot_kernel),
K split over programs where the weight has too few rows to fill the GPU
(kernels/small_batch.py, as the FP8 kernel does).
Every fused step rounds to the tensor dtype where the unfused kernels store, so both paths
give the same values: with a norm, each program first takes its rows' 1/rms in a pass over the
whole input row (from L2), then normalises each chunk as the unfused norm stores it.
"""

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ostinato.kernels.activation import silu_and_mul_torch
from ostinato.kernels.dispatch import (
    interpreting,
    jit,
    num_sms,
    pdl_options,
    split_counts,
    use_triton,
)
from ostinato.kernels.fp8 import dequantize
from ostinato.kernels.launch import Launch
from ostinato.kernels.norm import rms_norm_torch
from ostinato.kernels.small_batch import (
    GemvConfig,
    arrive,
    gather,
    input_chunk,
    load_weights,
    split_span,
)

# The most rows of x that take the kernel, by weight size: entries (weight elements at most,
# rows at most) by increasing size, the first that holds the weight decides; a weight larger
# than every entry takes cuBLAS. ROW_LIMITS holds for a projection with the norm in its
# prologue (tl.dot on x as stored: NORMED_DOT_TILE), PLAIN_ROW_LIMITS for one without (the
# swapped tl.dot: DOT_TILE), which a normed projection that ROW_LIMITS refuses also takes
# after a norm kernel (layers/linear.py: Linear.plan). On the H100 (`bench_kernels.py
# --sections gemv-rows`, benchmarks/h100-2026-11-25-s18.md) the normed tl.dot beat cuBLAS and
# the separate kernels at 2-16 rows only for weights of at most 3M elements, and lost for
# larger ones (0.77-0.99x) and at 32 rows everywhere; in qwen3-0.6b's decode step it took
# 10-17% off at batch 2-8 and nothing at 16 (benchmarks/h100-2026-11-26-s19.md). The swapped
# one beats cuBLAS at 2-32 rows on qwen3-0.6b's o and down (1.09-1.45x, h100-2026-11-27-s36);
# qwen3-0.6b's qkv and gate|up (4-6M elements) after a norm kernel made its decode step 3-10%
# slower at batch 8-32, qwen3-30b-a3b's qkv and o (10.5M, 8.4M) 1% at batch 4-32: both stay on
# cuBLAS above one row; all of llama-3.1-8b's (17-117M) swapped, norm first where they have
# one, made its step 4-8% faster at batch 4-32 (h100-2026-11-28-s37), though its o alone
# loses at 32 rows. One row (FMAs, in gemv_config's launch) reads at 1.00-1.13x the copy
# floor up to llama-3.1-8b's MLP, the largest weights measured, where the unfused path (norm,
# cuBLAS, SiLU) takes 1.09-1.13x longer (gate|up, 117M elements: 77.5 against 88.0 us; down,
# K = 14336: 40.3 against 43.9; benchmarks/h100-2026-11-26-s27.md): MAX_K and
# MAX_WEIGHT_ELEMENTS are those measured bounds.
MAX_K = 14336
MAX_WEIGHT_ELEMENTS = 28672 * 4096
ROW_LIMITS: tuple[tuple[int, int], ...] = ((3 << 20, 8), (MAX_WEIGHT_ELEMENTS, 1))
PLAIN_ROW_LIMITS: tuple[tuple[int, int], ...] = (
    (3 << 20, 32),
    (12 << 20, 1),
    (MAX_WEIGHT_ELEMENTS, 32),
)
DOT_ROWS = 2  # from here the rows go through tl.dot
# Warps of a one-row program over FP8 weights (8 for wider ones). On the H100, in
# llama-3.1-8b's FP8 decode step at batch 1: 3.36-3.43 ms with 4, 3.67 with 8, 3.59 on fp8.py's
# unfused kernels; alone, 4 weight rows x 2048 columns in 4 warps ran 1.02-1.26x faster than
# fp8.py's kernel and within 5% of the best of a grid (qkv; the others within 0.3%)
# (benchmarks/h100-2026-11-28-s39.md).
FP8_ROW_WARPS = 4
# The tl.dot rows' tiles: weight rows a program, K columns a chunk, and whether the product
# runs swapped (weight tile @ x.T: on Hopper a wgmma with the weight rows on its M side, where
# x @ w.T pads x's rows to the M side of an mma.sync). Swapped, x goes to the tensor cores from
# shared memory, which a norm prologue's rows, made in registers, must pass through each chunk:
# with a norm the swapped 64 x 128 took 1.2-1.3x the unswapped 64 x 64 (qwen3-0.6b's qkv and
# gate|up at 2-16 rows); without, 0.87-0.96x (o, down), all on the H100
# (benchmarks/h100-2026-11-27-s36.md).
DOT_TILE = (64, 128, True)
NORMED_DOT_TILE = (64, 64, False)


def max_rows(weight_elements: int, normed: bool = False) -> int:
    """The most rows of x that take the kernel for a weight of this many elements."""
    for elements, rows in ROW_LIMITS if normed else PLAIN_ROW_LIMITS:
        if weight_elements <= elements:
            return rows
    return 0


def rows_pay(rows: int, n: int, k: int, normed: bool = False) -> bool:
    """Whether `rows` rows of x times an [n, k] weight take the kernel, with the norm in its
    prologue or without (ROW_LIMITS, PLAIN_ROW_LIMITS; one row only where one_row_pays)."""
    return rows <= max_rows(n * k, normed) and (rows != 1 or one_row_pays(n, k))


def one_row_pays(n: int, k: int) -> bool:
    """Where the one-row kernel (FMAs) was measured beating cuBLAS, whatever ROW_LIMITS says."""
    return k <= MAX_K and n * k <= MAX_WEIGHT_ELEMENTS


def gemv_pays(x: torch.Tensor, weight: torch.Tensor, normed: bool = False) -> bool:
    """Whether this projection takes the kernel (rows_pay), normed: with a norm prologue; FP8
    weights (with a scale a row) at one row, where one_row_pays (more rows take fp8.py's
    kernel). Shapes alone decide, so a graph's eager warm-up launches the kernels its capture
    will (graphs/capture.py relies on that)."""
    if not x.is_cuda or x.dim() != 2:
        return False
    if weight.dtype == torch.float8_e4m3fn:
        return x.shape[0] == 1 and one_row_pays(*weight.shape)
    return x.dtype == weight.dtype and rows_pay(x.shape[0], *weight.shape, normed)


def gemv(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]; with silu_and_mul, gate rows then up rows
    bias: torch.Tensor | None = None,
    silu_and_mul: bool = False,
    add: torch.Tensor | None = None,  # [M, N or N / 2]: added to the output (a residual)
    config: GemvConfig | None = None,
    scale: torch.Tensor | None = None,  # float32 [N, 1] where weight is FP8 (one row of x)
) -> torch.Tensor:
    """x @ weight.T (+ bias), the weight times its rows' scales where it is FP8; with
    silu_and_mul, silu(gate) * up -> [M, N / 2]; then + add. The output is a new tensor (add
    is only read). config: gemv_config's unless given (benchmarks time others)."""
    if use_triton(x):
        return _gemv_triton(x, weight, bias, silu_and_mul, add=add, config=config, scale=scale)[0]
    return gemv_torch(x, weight, bias, silu_and_mul, add=add, scale=scale)


def gemv_normed(
    x: torch.Tensor,  # [M, K]
    residual: torch.Tensor | None,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu_and_mul: bool = False,
    config: GemvConfig | None = None,
    normed_out: bool = False,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """(gemv(rms_norm(s), ...), s) with s = x + residual (a new tensor), or s = x without a
    residual; normed_out: rms_norm(s) (a new tensor) third, for other consumers of the norm
    (a MoE block's experts beside its router). x and residual are only read."""
    if use_triton(x):
        return _gemv_triton(
            x, weight, bias, silu_and_mul, residual, norm_weight, eps, config=config,
            normed_out=normed_out, scale=scale,
        )  # fmt: skip
    return gemv_normed_torch(
        x, residual, norm_weight, eps, weight, bias, silu_and_mul, normed_out, scale
    )


def gemv_torch(x, weight, bias=None, silu_and_mul=False, add=None, scale=None):
    if scale is not None:  # FP8: dequantised, as fp8_linear's CPU path
        weight = dequantize(weight, scale, None).to(x.dtype)
    y = F.linear(x, weight, bias)
    y = silu_and_mul_torch(y) if silu_and_mul else y
    return y if add is None else y + add


def gemv_normed_torch(
    x, residual, norm_weight, eps, weight, bias=None, silu_and_mul=False, normed_out=False,
    scale=None,
):  # fmt: skip
    stream = x if residual is None else x + residual
    normed = rms_norm_torch(stream, norm_weight, eps)
    y = gemv_torch(normed, weight, bias, silu_and_mul, scale=scale)
    return (y, stream, normed) if normed_out else (y, stream)


def gemv_config(
    m: int, n_out: int, k: int, itemsize: int, sms: int, normed: bool = False, fp8: bool = False
) -> GemvConfig:
    """The launch configuration for m rows of x and n_out output columns (gate|up: its gate
    rows) over K, normed: with a norm prologue, fp8: FP8 weights (one row: FP8_ROW_WARPS);
    from shapes alone (fixed under a graph).

    One row: K in chunks of up to 2048 columns, unrolled so all their loads issue at once, 8
    warps, and 16 weight rows a program for K up to 1024, 4 above. The H100 sweep
    (`bench_kernels.py --sections gemv-row-sweep`, benchmarks/h100-2026-11-26-s20.md) put
    these 1.1-2x ahead of the chunks of 512 and rows for about 512 programs used before, on
    qwen3-0.6b's, qwen3-30b-a3b's and llama-3.1-8b's projections: fewer, longer chunks keep
    more bytes in flight per program.
    More rows: tl.dot on x padded to 16 or 32 rows, DOT_TILE's (with a norm NORMED_DOT_TILE's)
    weight rows a program in its chunks of columns (a pipeline of 4), and K split until there
    are about two programs per SM, each split at least 4 chunks so the pipeline fills and the
    fp32 partials stay small beside the weights. float32 weights keep a pipeline of 2 (their
    tiles take twice the shared memory)."""
    if m < DOT_ROWS:
        block_k = min(2048, triton.next_power_of_2(k))
        block_n = min(16 if block_k <= 1024 else 4, triton.next_power_of_2(n_out))
        warps = FP8_ROW_WARPS if fp8 else 8
        return GemvConfig(1, block_n, block_k, triton.cdiv(k, block_k) * block_k, 1, warps, 1)
    return dot_config(m, n_out, k, *(NORMED_DOT_TILE if normed else DOT_TILE), itemsize, sms)


def dot_config(
    m: int, n_out: int, k: int, block_n: int, block_k: int, swap: bool, itemsize: int, sms: int
) -> GemvConfig:
    """gemv_config's tl.dot configuration for a given tile (benchmarks time several)."""
    rows = 16 if m <= 16 else 32
    tiles = triton.cdiv(n_out, block_n) * triton.cdiv(m, rows)
    split = max(1, min(2 * sms // tiles, k // (4 * block_k)))
    span, split = split_span(k, block_k, split, tiles)
    stages = 4 if itemsize <= 2 else 2
    return GemvConfig(rows, block_n, block_k, span, split, 4, stages, swap=swap)


@jit
def _activate(gate, up, cols, col_ok, bias_ptr, y_ptr, n_out, HAS_BIAS: tl.constexpr,
              SILU: tl.constexpr):  # fmt: skip
    """The projection's output columns cols from the float32 products (gate only without
    SILU): + bias, then silu(gate) * up, each rounded where the unfused kernels store."""
    if HAS_BIAS:
        gate += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        if SILU:
            up += tl.load(bias_ptr + n_out + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = gate
    if SILU:
        # rounded to the output dtype first, as the unfused projection stores it
        g = gate.to(y_ptr.dtype.element_ty).to(tl.float32)
        y = g * tl.sigmoid(g) * up.to(y_ptr.dtype.element_ty).to(tl.float32)
    return y


@jit
def _gemv_row_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, res_ptr, sum_ptr, norm_ptr, normed_ptr, scale_ptr, n_out, K,
    eps, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, NORM: tl.constexpr, ADD_IN: tl.constexpr,
    ADD_OUT: tl.constexpr, NORM_OUT: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One row of x: BLOCK_N output columns per program over the whole K, unrolled in CHUNKS
    of BLOCK_K so every weight load is independent of the arithmetic and can be in flight at
    once. With SILU, column j combines weight rows j (gate) and n_out + j (up). With NORM the
    row is normalised first, by every program (after adding res_ptr's row with ADD_IN;
    program 0 stores the sum at sum_ptr, and with NORM_OUT the normalised row at normed_ptr);
    with ADD_OUT, res_ptr's row is added to the output. FP8: the weights are FP8 with one
    float32 scale a row at scale_ptr, each row's sum times its scale before the bias, as
    fp8.py's kernel scales them."""
    stored = tl.where(tl.program_id(0) == 0, K, 0)  # the columns this program stores of a sum
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    # the first chunk of weights, which no kernel writes, is read while the one before drains
    ok = col_ok[:, None] & (k < K)[None, :]
    w_first = tl.load(w_rows + k[None, :], mask=ok, other=0.0)
    u_first = w_first
    if SILU:
        u_first = tl.load(w_rows + n_out * stride_wn + k[None, :], mask=ok, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if ADD_OUT:  # loaded now, so its latency hides behind the weights'
        r_out = tl.load(res_ptr + cols[None, :], mask=col_ok[None, :], other=0.0)
    if NORM:  # a pass over the input row (from L2) for its norm
        squares = tl.zeros([BLOCK_K], tl.float32)
        for c in tl.static_range(CHUNKS):
            kk = c * BLOCK_K + k
            xc = input_chunk(x_ptr + kk, res_ptr + kk, kk < K, ADD_IN)
            if ADD_IN:
                tl.store(sum_ptr + kk, xc, mask=kk < stored)
            xc = xc.to(tl.float32)
            squares += xc * xc
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    gate = tl.zeros([1, BLOCK_N], tl.float32)
    up = tl.zeros([1, BLOCK_N], tl.float32)
    for c in tl.static_range(CHUNKS):
        kk = c * BLOCK_K + k
        ok = col_ok[:, None] & (kk < K)[None, :]
        if c == 0:
            w, u = w_first.to(tl.float32), u_first.to(tl.float32)
        else:
            w = tl.load(w_rows + kk[None, :], mask=ok, other=0.0).to(tl.float32)
            if SILU:
                u = tl.load(w_rows + n_out * stride_wn + kk[None, :], mask=ok, other=0.0)
                u = u.to(tl.float32)
        xc = input_chunk(x_ptr + kk, res_ptr + kk, kk < K, ADD_IN).to(tl.float32)
        if NORM:  # rounded as the unfused norm stores its output
            g = tl.load(norm_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            xc = (xc * rstd * g).to(x_ptr.dtype.element_ty)
            if NORM_OUT:
                tl.store(normed_ptr + kk, xc, mask=kk < stored)
            xc = xc.to(tl.float32)
        gate += tl.sum(w * xc[None, :], axis=1)[None, :]
        if SILU:
            up += tl.sum(u * xc[None, :], axis=1)[None, :]
    if FP8:
        gate *= tl.load(scale_ptr + cols[None, :], mask=col_ok[None, :], other=0.0)
        if SILU:
            up *= tl.load(scale_ptr + n_out + cols[None, :], mask=col_ok[None, :], other=0.0)
    y = _activate(gate, up, cols[None, :], col_ok[None, :], bias_ptr, y_ptr, n_out, HAS_BIAS, SILU)
    if ADD_OUT:  # the projection rounds as stored, then the residual add rounds again
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32) + r_out.to(tl.float32)
    tl.store(y_ptr + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=col_ok[None, :])


@jit
def _dot(x, w, acc, F32_DOT: tl.constexpr, SWAP: tl.constexpr):
    """acc + x @ w.T, or with SWAP its transpose acc + w @ x.T; F32_DOT: in float32 (float32
    models; the interpreter, whose bfloat16 dot is wrong)."""
    a, b = (w, x) if SWAP else (x, w)  # one product below: the compiler visits every return
    if F32_DOT:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(b), acc)


@jit(do_not_specialize=["M"])  # one compiled kernel serves every batch of the same padding
def _gemv_dot_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, res_ptr, sum_ptr, norm_ptr, normed_ptr, part_ptr, sem_ptr, M,
    n_out, K, eps, span, stride_xm, stride_wn, stride_ym, stride_rm, stride_sm, stride_pm,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, NORM: tl.constexpr, ADD_IN: tl.constexpr,
    ADD_OUT: tl.constexpr, NORM_OUT: tl.constexpr, F32_DOT: tl.constexpr, EVEN: tl.constexpr,
    SWAP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """ROWS rows of x (from program_id(2) * ROWS; rows from M on masked to 0) times BLOCK_N
    weight rows (program_id(0)) over `span` columns of K (program_id(1) of SPLIT): tl.dot of
    x's [ROWS, BLOCK_K] chunks with the weight tiles, transposed, in a pipelined loop; with
    SILU a second product with the up rows n_out + cols. NORM: x (after adding res_ptr's with
    ADD_IN; the programs of column tile 0 store that sum at sum_ptr) is normalised chunk by
    chunk, rounded as the unfused norm stores it, by the rows' 1/rms from a first pass over
    the whole rows (every split needs all of K for it); with NORM_OUT the programs of column
    tile 0 store the normalised rows at normed_ptr (rows stride_sm apart, as the sum's). With
    ADD_OUT, res_ptr's rows are added to the output. EVEN: no masks on the weights. SWAP: the
    products accumulate transposed, weight tile @ x.T, so the weight rows fill the tensor
    cores' M side (Hopper's wgmma; x's few rows on the N side) instead of x's rows padded there.

    SPLIT > 1: each program stores its fp32 partials in part_ptr [SPLIT, M, stride_pm] (the
    products at their weight rows' columns) and counts itself in sem_ptr; the last of a tile's
    programs sums them and finishes the tile (kernels/small_batch.py)."""
    tile, split = tl.program_id(0), tl.program_id(1)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    rows = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rows[:, None] * stride_xm
    r_rows = res_ptr + rows[:, None] * stride_rm
    if PDL:  # the pipelined loop issues its first loads before the loop: all after this
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if ADD_OUT:  # loaded now, so its latency hides behind the weights'
        r_out = tl.load(r_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    if NORM:
        squares = tl.zeros([ROWS, BLOCK_K], tl.float32)  # summed once, after the last chunk
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k
            x_ok = row_ok[:, None] if EVEN else row_ok[:, None] & (kk < K)[None, :]
            xf = input_chunk(x_rows + kk[None, :], r_rows + kk[None, :], x_ok, ADD_IN)
            xf = xf.to(tl.float32)
            squares += xf * xf
        rstd = tl.rsqrt(tl.sum(squares, axis=1) / K + eps)[:, None]
    gate = tl.zeros([BLOCK_N, ROWS], tl.float32) if SWAP else tl.zeros([ROWS, BLOCK_N], tl.float32)
    up = tl.zeros_like(gate)
    k_lo = split * span
    for k0 in range(k_lo, tl.minimum(k_lo + span, K), BLOCK_K):
        kk = k0 + k
        x_ok = row_ok[:, None] if EVEN else row_ok[:, None] & (kk < K)[None, :]
        xc = input_chunk(x_rows + kk[None, :], r_rows + kk[None, :], x_ok, ADD_IN)
        stored = tl.where(tile == 0, x_ok, False)  # (the interpreter's & gives integers)
        if ADD_IN:
            tl.store(sum_ptr + rows[:, None] * stride_sm + kk[None, :], xc, mask=stored)
        if NORM:  # rounded as the unfused norm stores its output
            g = tl.load(norm_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            xc = (xc.to(tl.float32) * rstd * g[None, :]).to(x_ptr.dtype.element_ty)
            if NORM_OUT:
                tl.store(normed_ptr + rows[:, None] * stride_sm + kk[None, :], xc, mask=stored)
        gate = _dot(xc, load_weights(w_rows, kk, col_ok, K, EVEN), gate, F32_DOT, SWAP)
        if SILU:
            u = load_weights(w_rows + n_out * stride_wn, kk, col_ok, K, EVEN)
            up = _dot(xc, u, up, F32_DOT, SWAP)
    if SWAP:
        gate, up = tl.trans(gate), tl.trans(up)
    if SPLIT > 1:
        ok = row_ok[:, None] & col_ok[None, :]
        step = M * stride_pm  # from one split's partials to the next
        parts = part_ptr + rows[:, None] * stride_pm + cols[None, :]
        tl.store(parts + split * step, gate, mask=ok)
        if SILU:
            tl.store(parts + n_out + split * step, up, mask=ok)
        sem = sem_ptr + tl.program_id(2) * tl.num_programs(0) + tile
        last = arrive(sem, SPLIT)
        row_ok = tl.where(last, row_ok, False)
        ok = tl.where(last, ok, False)
        gate = gather(parts, step, ok, SPLIT)
        if SILU:
            up = gather(parts + n_out, step, ok, SPLIT)
        tl.store(sem, 0, mask=last)
    y = _activate(gate, up, cols[None, :], col_ok[None, :], bias_ptr, y_ptr, n_out, HAS_BIAS,
                  SILU)  # fmt: skip
    if ADD_OUT:  # the projection rounds as stored, then the residual add rounds again
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32) + r_out.to(tl.float32)
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


class GemvPlan:
    """One kind of gemv / gemv_normed call (shapes, strides, dtype, device, fusions, eps): its
    checks, configuration and Launch, made once, so a call only allocates the output (and the
    stream's sum) and launches. _gemv_triton keeps one per key; each projection keeps one per
    input kind (layers/linear.py), which spares it even that key."""

    def __init__(
        self, x, weight, bias, silu_and_mul, residual=None, norm_weight=None, eps=0.0,
        add=None, config=None, normed_out=False, scale=None,
    ):  # fmt: skip
        m, k = x.shape
        n_out = weight.shape[0] // 2 if silu_and_mul else weight.shape[0]
        norm, add_in = norm_weight is not None, residual is not None
        self.m, self.k, self.n_out, self.add_in, self.launch = m, k, n_out, add_in, None
        self.normed_out = normed_out
        if m == 0:
            return
        res = residual if add_in else add
        assert not (add_in and add is not None) and (norm or not add_in)
        assert norm or not normed_out
        assert x.stride(1) == weight.stride(1) == 1 and weight.shape[1] == k
        assert res is None or (res.stride(1) == 1 and res.shape == (m, k if add_in else n_out))
        sms = num_sms(x.device, 4)
        config = config or gemv_config(m, n_out, k, x.element_size(), sms, norm, scale is not None)
        assert (scale is None) == (weight.dtype != torch.float8_e4m3fn)
        assert scale is None or (config.rows == 1 and scale.shape == (weight.shape[0], 1))
        flags = dict(HAS_BIAS=bias is not None, SILU=silu_and_mul, NORM=norm, ADD_IN=add_in,
                     ADD_OUT=add is not None, NORM_OUT=normed_out)  # fmt: skip
        stride_r = 0 if res is None else res.stride(0)
        # the stored rows (the sum, the normalised input) are new contiguous tensors
        stride_s = k if add_in or normed_out else x.stride(0)
        strides = (x.stride(0), weight.stride(0), stride_r, stride_s)
        if config.rows == 1:
            self.launch = _row_launch(m, k, n_out, eps, strides, flags, scale is not None, config)
        else:
            self.launch = _dot_launch(m, k, n_out, eps, strides, flags, config, x.dtype)
        self.rows, self.split = config.rows, config.split
        self.part_width = _part_width(n_out, silu_and_mul)

    def __call__(self, x, weight, bias=None, residual=None, norm_weight=None, add=None, scale=None):
        """-> (y, the input stream: x + residual when it adds a residual first, else x), and
        with normed_out the normalised input third (scale: FP8 weights' per row). The new
        tensors are contiguous, in x's dtype, on its device (new_empty: the cheapest
        allocation from Python, about 1 µs under torch.empty with a dtype and device)."""
        y = x.new_empty(self.m, self.n_out)
        stream = x.new_empty(self.m, self.k) if self.add_in else x
        normed = x.new_empty(self.m, self.k) if self.normed_out else None
        outputs = (y, stream) if normed is None else (y, stream, normed)
        launch = self.launch
        if launch is None:
            return outputs
        res = residual if self.add_in else add
        head = (x, weight, x if bias is None else bias, y, x if res is None else res, stream,
                x if norm_weight is None else norm_weight,
                x if normed is None else normed)  # fmt: skip
        if self.rows == 1:
            launch.run(launch.grid, *head, x if scale is None else scale)
            return outputs
        part = sem = x  # unused without a split
        if self.split > 1:
            part = torch.empty(self.split, self.m, self.part_width, dtype=torch.float32,
                               device=x.device)  # fmt: skip
            sem = split_counts(x.device, "GEMV")
        launch.run(launch.grid, *head, part, sem)
        return outputs


def gemv_plan(
    x, weight, bias, silu_and_mul, residual=None, norm_weight=None, eps=0.0, add=None,
    scale=None,
) -> Callable:  # fmt: skip
    """What runs calls like this gemv / gemv_normed (the same shapes, strides, dtype, device,
    fusions and eps): `plan(x, weight, bias, residual, norm_weight, add)` -> (y, stream), as
    _gemv_triton returns, FP8 weights with this scale bound. A GemvPlan where Triton runs,
    else the torch twins."""
    if use_triton(x):
        plan = GemvPlan(x, weight, bias, silu_and_mul, residual, norm_weight, eps, add,
                        scale=scale)  # fmt: skip
    else:
        plan = partial(_gemv_pair_torch, silu_and_mul=silu_and_mul, eps=eps)
    return plan if scale is None else partial(plan, scale=scale)


def _gemv_pair_torch(x, weight, bias, residual, norm_weight, add, silu_and_mul, eps, scale=None):
    if norm_weight is None:
        return gemv_torch(x, weight, bias, silu_and_mul, add=add, scale=scale), x
    return gemv_normed_torch(x, residual, norm_weight, eps, weight, bias, silu_and_mul, scale=scale)


_plans: dict[tuple, GemvPlan] = {}


def _gemv_triton(
    x, weight, bias, silu_and_mul, residual=None, norm_weight=None, eps=0.0, add=None,
    config=None, normed_out=False, scale=None,
):  # fmt: skip
    """-> (y, the input stream: x + residual when normed with a residual, else x), and with
    normed_out the normalised input."""
    res = residual if residual is not None else add
    # shapes and whole stride tuples: one call each, and everything the plan's checks and
    # launch read of them
    key = (x.device, x.dtype, x.shape, x.stride(), weight.dtype, weight.shape, weight.stride(),
           bias is not None, silu_and_mul, norm_weight is not None, residual is not None,
           add is not None, res is not None and (res.shape, res.stride()), eps, config,
           normed_out, interpreting())  # fmt: skip
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = GemvPlan(
            x, weight, bias, silu_and_mul, residual, norm_weight, eps, add, config, normed_out,
            scale,
        )  # fmt: skip
    return plan(x, weight, bias, residual, norm_weight, add, scale)


def _part_width(n_out: int, silu: bool) -> int:
    """Columns of a split's partials: one per weight row."""
    return n_out * (2 if silu else 1)


def _row_launch(m, k, n_out, eps, strides, flags, fp8, config: GemvConfig) -> Launch:
    assert m == 1 and config.split == 1 and config.span % config.block_k == 0
    pdl = pdl_options()
    return Launch(
        _gemv_row_kernel,
        (triton.cdiv(n_out, config.block_n), 1, 1),
        num_head=9,  # x, weight, bias, y, residual, stream, norm weight, normed, scale
        tail=(n_out, k, eps, strides[1]),
        constexprs=dict(
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            CHUNKS=config.span // config.block_k,
            **flags,
            FP8=fp8,
            PDL=pdl["PDL"],
        ),
        num_warps=config.num_warps,
        launch_pdl=pdl["launch_pdl"],
    )


def _dot_launch(m, k, n_out, eps, strides, flags, config: GemvConfig, dtype) -> Launch:
    stride_p = _part_width(n_out, flags["SILU"])
    pdl = pdl_options()
    return Launch(
        _gemv_dot_kernel,
        (triton.cdiv(n_out, config.block_n), config.split, triton.cdiv(m, config.rows)),
        num_head=10,  # x, weight, bias, y, residual, stream, norm weight, normed, partials, counts
        tail=(m, n_out, k, eps, config.span, *strides[:2], n_out, *strides[2:], stride_p),
        constexprs=dict(
            ROWS=config.rows,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            SPLIT=config.split,
            **flags,
            F32_DOT=dtype == torch.float32 or interpreting(),
            EVEN=n_out % config.block_n == 0 and k % config.block_k == 0,
            SWAP=config.swap,
            PDL=pdl["PDL"],
        ),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=pdl["launch_pdl"],
    )
