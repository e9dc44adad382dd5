"""x @ weight.T for the few rows of a decode batch, optionally fused with the RMSNorm before it,
SiLU-and-mul, and the residual add after it.

cuBLAS runs a small decode projection (a few MB of weights) as a latency-bound GEMM with few
thread blocks, at a third of the copy bandwidth, some as a split-K GEMM plus a reduction
kernel. Here every program reads a few whole weight rows with all their loads in flight, and
what would be separate small kernels around it runs inside it:
- a norm prologue: each program normalises the input row itself (the hidden size is small,
  the row comes from L2), adding the residual first when the norm is the fused add + norm;
  program 0 stores that sum, the residual stream the layer goes on with;
- SiLU-and-mul over a merged gate|up projection before storing;
- a residual epilogue: the output is the projection plus the residual stream, so the norm
  that follows reads one tensor.
Every fused step rounds to the tensor dtype where the unfused kernels store, so both paths
give the same values.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ostinato.kernels.activation import silu_and_mul_torch
from ostinato.kernels.dispatch import interpreting, jit, pdl_options, use_triton
from ostinato.kernels.launch import Launch
from ostinato.kernels.norm import rms_norm_torch

# Where it beat cuBLAS on the H100 (benchmarks/perf-h100.md): one row, 1.06-1.35x for weights
# of 4-50 MB with K up to 4096; at 4 rows it lost (0.4-0.8x), and at K = 8192 it lost (0.95x).
MAX_ROWS = 1
MAX_K = 4096
MAX_WEIGHT_ELEMENTS = 32 << 20
_PROGRAMS = 512  # enough programs to keep every SM's memory pipe busy


def gemv_pays(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this projection takes the kernel: one row and a weight of at most MAX_K columns
    and MAX_WEIGHT_ELEMENTS. Shapes alone decide, so a graph's eager warm-up launches the
    kernels its capture will (graphs/capture.py relies on that)."""
    return (
        x.is_cuda
        and x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and weight.shape[1] <= MAX_K
        and weight.numel() <= MAX_WEIGHT_ELEMENTS
        and x.dtype == weight.dtype
    )


def gemv(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]; with silu_and_mul, gate rows then up rows
    bias: torch.Tensor | None = None,
    silu_and_mul: bool = False,
    add: torch.Tensor | None = None,  # [M, N or N / 2]: added to the output (a residual)
) -> torch.Tensor:
    """x @ weight.T (+ bias); with silu_and_mul, silu(gate) * up -> [M, N / 2]; then + add.
    The output is a new tensor (add is only read)."""
    if use_triton(x):
        return _gemv_triton(x, weight, bias, silu_and_mul, add=add)[0]
    return gemv_torch(x, weight, bias, silu_and_mul, add=add)


def gemv_normed(
    x: torch.Tensor,  # [M, K]
    residual: torch.Tensor | None,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu_and_mul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gemv(rms_norm(s), ...), s) with s = x + residual (a new tensor), or s = x without a
    residual. x and residual are only read."""
    if use_triton(x):
        return _gemv_triton(x, weight, bias, silu_and_mul, residual, norm_weight, eps)
    return gemv_normed_torch(x, residual, norm_weight, eps, weight, bias, silu_and_mul)


def gemv_torch(x, weight, bias=None, silu_and_mul=False, add=None):
    y = F.linear(x, weight, bias)
    y = silu_and_mul_torch(y) if silu_and_mul else y
    return y if add is None else y + add


def gemv_normed_torch(x, residual, norm_weight, eps, weight, bias=None, silu_and_mul=False):
    stream = x if residual is None else x + residual
    return gemv_torch(rms_norm_torch(stream, norm_weight, eps), weight, bias, silu_and_mul), stream


@jit
def _input_chunk(x_ptr, res_ptr, m, kk, K, stride_xm, stride_rm, ADD_IN: tl.constexpr):
    """Columns kk of input row m, as the unfused kernels store it: x, or x + residual rounded
    to the dtype."""
    x = tl.load(x_ptr + m * stride_xm + kk, mask=kk < K, other=0.0)
    if ADD_IN:
        r = tl.load(res_ptr + m * stride_rm + kk, mask=kk < K, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x


@jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, res_ptr, sum_ptr, norm_ptr,
    n_out, K, eps, stride_xm, stride_wn, stride_ym, stride_rm, stride_sm,
    M: tl.constexpr, M_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    CHUNKS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, NORM: tl.constexpr,
    ADD_IN: tl.constexpr, ADD_OUT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """BLOCK_N output columns per program over the whole K, unrolled in CHUNKS of BLOCK_K so
    every weight load is independent of the arithmetic and can be in flight at once. With
    SILU, column j combines weight rows j (gate) and n_out + j (up). With NORM the input rows
    are normalised first (after adding res_ptr's rows with ADD_IN; program 0 stores the sum at
    sum_ptr); with ADD_OUT, res_ptr's rows are added to the output."""
    stored = tl.where(tl.program_id(0) == 0, K, 0)  # the columns this program stores of a sum
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    rows = tl.arange(0, M_P2)
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
    out_ok = (rows[:, None] < M) & col_ok[None, :]
    if ADD_OUT:  # loaded now, so its latency hides behind the weights'
        r_out = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=out_ok, other=0.0)
    rstd = tl.zeros([M_P2], tl.float32)
    if NORM:  # a pass over the input rows (from L2) for their norms
        for m in tl.static_range(M):
            squares = tl.zeros([BLOCK_K], tl.float32)
            for c in tl.static_range(CHUNKS):
                kk = c * BLOCK_K + k
                xm = _input_chunk(x_ptr, res_ptr, m, kk, K, stride_xm, stride_rm, ADD_IN)
                if ADD_IN:
                    tl.store(sum_ptr + m * stride_sm + kk, xm, mask=kk < stored)
                xm = xm.to(tl.float32)
                squares += xm * xm
            rstd = tl.where(rows == m, tl.rsqrt(tl.sum(squares, axis=0) / K + eps), rstd)
    gate = tl.zeros([M_P2, BLOCK_N], tl.float32)
    up = tl.zeros([M_P2, BLOCK_N], tl.float32)
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
        if NORM:
            g = tl.load(norm_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        for m in tl.static_range(M):
            xm = _input_chunk(x_ptr, res_ptr, m, kk, K, stride_xm, stride_rm, ADD_IN)
            xm = xm.to(tl.float32)
            if NORM:  # rounded as the unfused norm stores its output
                r_m = tl.sum(tl.where(rows == m, rstd, 0.0), axis=0)
                xm = (xm * r_m * g).to(x_ptr.dtype.element_ty).to(tl.float32)
            row = rows[:, None] == m
            gate = tl.where(row, gate + tl.sum(w * xm[None, :], axis=1)[None, :], gate)
            if SILU:
                up = tl.where(row, up + tl.sum(u * xm[None, :], axis=1)[None, :], up)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if SILU:
            up += tl.load(bias_ptr + n_out + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = gate
    if SILU:
        # rounded to the output dtype first, as the unfused projection stores it
        g = gate.to(y_ptr.dtype.element_ty).to(tl.float32)
        y = g * tl.sigmoid(g) * up.to(y_ptr.dtype.element_ty).to(tl.float32)
    if ADD_OUT:  # the projection rounds as stored, then the residual add rounds again
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32) + r_out.to(tl.float32)
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=out_ok)


_launches: dict[tuple, Launch] = {}  # per shape: eager calls skip Triton's Python launch path


def _gemv_triton(x, weight, bias, silu_and_mul, residual=None, norm_weight=None, eps=0.0, add=None):
    """-> (y, the input stream: x + residual when normed with a residual, else x)."""
    m, k = x.shape
    n_out = weight.shape[0] // 2 if silu_and_mul else weight.shape[0]
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    norm, add_in = norm_weight is not None, residual is not None
    stream = torch.empty_like(x) if add_in else x
    if m == 0:
        return y, stream
    res = residual if add_in else add
    assert not (add_in and add is not None) and (norm or not add_in)
    assert x.stride(1) == weight.stride(1) == 1 and weight.shape[1] == k
    assert res is None or (res.stride(1) == 1 and res.shape == (m, k if add_in else n_out))
    stride_r = 0 if res is None else res.stride(0)
    key = (x.device, x.dtype, m, k, n_out, x.stride(0), weight.stride(0), bias is not None,
           silu_and_mul, norm, add_in, add is not None, stride_r, stream.stride(0), eps,
           interpreting())  # fmt: skip
    launch = _launches.get(key)
    if launch is None:
        launch = _launches[key] = _launch(
            m, k, n_out, x.stride(0), weight.stride(0), stride_r, stream.stride(0), eps, bias,
            silu_and_mul, norm, add_in, add is not None,
        )  # fmt: skip
    launch(
        x, weight, x if bias is None else bias, y, x if res is None else res, stream,
        x if norm_weight is None else norm_weight,
    )  # fmt: skip
    return y, stream


def _launch(
    m, k, n_out, stride_x, stride_w, stride_r, stride_s, eps, bias, silu_and_mul, norm, add_in,
    add_out,
) -> Launch:  # fmt: skip
    block_k = min(512, triton.next_power_of_2(k))
    # few columns per program, so the grid has enough programs; at most 16 rows per program
    block_n = max(1, min(16, triton.next_power_of_2(n_out) // _PROGRAMS))
    pdl = pdl_options()
    return Launch(
        _gemv_kernel,
        (triton.cdiv(n_out, block_n), 1, 1),
        num_head=7,  # x, weight, bias, y, residual, stream, norm weight
        tail=(n_out, k, eps, stride_x, stride_w, n_out, stride_r, stride_s),
        constexprs=dict(
            M=m,
            M_P2=triton.next_power_of_2(m),
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            CHUNKS=triton.cdiv(k, block_k),
            HAS_BIAS=bias is not None,
            SILU=silu_and_mul,
            NORM=norm,
            ADD_IN=add_in,
            ADD_OUT=add_out,
            PDL=pdl["PDL"],
        ),  # fmt: skip
        num_warps=4,
        launch_pdl=pdl["launch_pdl"],
    )
