"""x @ dequant(w).T for FP8 (float8_e4m3fn) weights with float32 scales: one per output row
(FP8 at load) or one per (block_n x block_k) block (block-wise checkpoints).

Small batches (decode) are bound by reading the weights: a Triton GEMV reads the FP8 bytes and
scales them in registers, x stays in the model dtype (weight-only: as exact as the dequantised
reference up to the order of the sum). Larger batches: per-row scales go through
torch._scaled_mm (x quantised per token to FP8, dynamic scales; bfloat16 models, float32 ones
dequantise); block scales through a Triton GEMM that scales each tile. On the CPU: dequantise,
then the same matmul, so CI tests the math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ostinato.kernels.dispatch import jit, pdl_options, use_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GEMV_ROWS = 8  # up to here the GEMV; above it _scaled_mm or the tiled GEMM
_PROGRAMS = 512


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (FP8 [N, K], float32 scale [N, 1]) with w ~ fp8 * scale per row."""
    scale = w.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None):
    """float32 [N, K]: each weight times its row's or its block's scale."""
    if block is not None:
        n, k = w.shape
        scale = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return w.float() * scale


def fp8_linear(
    x: torch.Tensor,  # [M, K]
    w: torch.Tensor,  # FP8 [N, K]
    scale: torch.Tensor,  # float32 [N, 1] or [ceil(N / bn), ceil(K / bk)]
    bias: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x @ dequantize(w, scale, block).T (+ bias) -> [M, N] in x's dtype."""
    big = x.shape[0] > GEMV_ROWS
    if not use_triton(x) or (big and block is None and x.dtype != torch.bfloat16):
        # the CPU; or a float32 model (tests): _scaled_mm's per-row scales give bfloat16 only
        return F.linear(x, dequantize(w, scale, block).to(x.dtype), bias)
    if big and block is not None:
        y = _gemm(x, w, scale, block)
    elif big and x.is_cuda:
        y = _scaled_mm(x, w, scale)
    else:  # the interpreter has no _scaled_mm
        y = _gemv(x, w, scale, block)
    return y if bias is None else y.add_(bias)


def _scaled_mm(x, w, scale):
    """Dynamic per-token FP8 activations times per-row FP8 weights on the tensor cores."""
    xq, x_scale = quantize_tokens(x)
    return torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=scale.t(), out_dtype=x.dtype)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], float32 [M, 1]) per token, in one kernel."""
    m, k = x.shape
    xq = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = min(4096, triton.next_power_of_2(k))
        _quantize_tokens_kernel[(m,)](
            x, xq, scale, k, x.stride(0), BLOCK=block, CHUNKS=triton.cdiv(k, block),
            num_warps=8, **pdl_options(),
        )  # fmt: skip
    return xq, scale


@jit
def _quantize_tokens_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_x, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for c in tl.static_range(CHUNKS):
        kk = c * BLOCK + offs
        v = tl.load(x_ptr + row * stride_x + kk, mask=kk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    s = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), 448.0)  # as torch divides
    tl.store(s_ptr + row, s)
    for c in tl.static_range(CHUNKS):
        kk = c * BLOCK + offs
        v = tl.load(x_ptr + row * stride_x + kk, mask=kk < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, s), -448.0), 448.0)
        tl.store(q_ptr + row * K + kk, q.to(q_ptr.dtype.element_ty), mask=kk < K)


@jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr,
    BLOCK_SN: tl.constexpr, BLOCKWISE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """BLOCK_N output columns per program over the whole K, for M <= ROWS rows (M at run
    time: one compiled kernel per weight shape serves every decode batch up to ROWS).
    BLOCKWISE: chunk c of BLOCK_K columns lies in scale column c (BLOCK_K is the block's
    width), rows n in scale row n // BLOCK_SN; else one scale per row, applied at the end."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, ROWS)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + (cols // BLOCK_SN).to(tl.int64) * stride_sn
    for c in tl.static_range(CHUNKS):
        kk = c * BLOCK_K + k
        ok = col_ok[:, None] & (kk < K)[None, :]
        w = tl.load(w_rows + kk[None, :], mask=ok, other=0.0).to(tl.float32)
        if BLOCKWISE:
            w = w * tl.load(s_rows + c, mask=col_ok, other=0.0)[:, None]
        for m in range(M):
            xm = tl.load(x_ptr + m * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
            row = rows[:, None] == m
            acc = tl.where(row, acc + tl.sum(w * xm[None, :], axis=1)[None, :], acc)
    if not BLOCKWISE:
        acc = acc * tl.load(s_rows, mask=col_ok, other=0.0)[None, :]
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & col_ok[None, :])


def _gemv(x, w, scale, block):
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_k = block[1] if block else min(512, triton.next_power_of_2(k))
    block_n = max(1, min(16, triton.next_power_of_2(n) // _PROGRAMS))
    if block:
        block_n = min(block_n, block[0])
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, scale, y, m, n, k, x.stride(0), w.stride(0), scale.stride(0), y.stride(0),
        ROWS=GEMV_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        CHUNKS=triton.cdiv(k, block_k), BLOCK_SN=block[0] if block else 1,
        BLOCKWISE=block is not None, num_warps=4, **pdl_options(),
    )  # fmt: skip
    return y


@jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_SN: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A [BLOCK_M, BLOCK_N] tile; each BLOCK_K step lies in one scale block (BLOCK_N divides
    the block's height, BLOCK_K is its width), so a tile's product is scaled once."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    s_row = s_ptr + (tl.program_id(1) * BLOCK_N // BLOCK_SN) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for c in range(0, tl.cdiv(K, BLOCK_K)):
        kk = c * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + cols.to(tl.int64)[None, :] * stride_wn + kk[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        part = tl.dot(a, w.to(tl.float32).to(a.dtype), input_precision=PRECISION)
        acc += part * tl.load(s_row + c)
    out = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _gemm(x, w, scale, block):
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_n = min(64, block[0])
    block_m = 64 if m > 32 else 32
    _fp8_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, w, scale, y, m, n, k, x.stride(0), w.stride(0), scale.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block[1], BLOCK_SN=block[0],
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_stages=2, **pdl_options(),
    )  # fmt: skip
    return y
