"""x @ weight.T for the few rows of a decode batch, optionally fused with SiLU-and-mul.

cuBLAS runs a small decode projection (a few MB of weights) as a latency-bound GEMM with few
thread blocks, at a third of the copy bandwidth, some as a split-K GEMM plus a reduction
kernel. Here every program reads a few whole weight rows with all their loads in flight, and
a merged gate|up projection applies SiLU-and-mul before storing (one kernel instead of two).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ostinato.kernels.activation import silu_and_mul_torch
from ostinato.kernels.dispatch import interpreting, jit, pdl_options, use_triton
from ostinato.kernels.launch import Launch

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
) -> torch.Tensor:
    """x @ weight.T (+ bias) -> [M, N]; with silu_and_mul, silu(gate) * up -> [M, N / 2]."""
    if use_triton(x):
        return _gemv_triton(x, weight, bias, silu_and_mul)
    return gemv_torch(x, weight, bias, silu_and_mul)


def gemv_torch(x, weight, bias=None, silu_and_mul=False):
    y = F.linear(x, weight, bias)
    return silu_and_mul_torch(y) if silu_and_mul else y


@jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, n_out, K, stride_xm, stride_wn, stride_ym,
    M: tl.constexpr, M_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    CHUNKS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """BLOCK_N output columns per program over the whole K, unrolled in CHUNKS of BLOCK_K so
    every weight load is independent of the arithmetic and can be in flight at once. With
    SILU, column j combines weight rows j (gate) and n_out + j (up)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    rows = tl.arange(0, M_P2)
    k = tl.arange(0, BLOCK_K)
    gate = tl.zeros([M_P2, BLOCK_N], tl.float32)
    up = tl.zeros([M_P2, BLOCK_N], tl.float32)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    for c in tl.static_range(CHUNKS):
        kk = c * BLOCK_K + k
        ok = col_ok[:, None] & (kk < K)[None, :]
        w = tl.load(w_rows + kk[None, :], mask=ok, other=0.0).to(tl.float32)
        if SILU:
            u = tl.load(w_rows + n_out * stride_wn + kk[None, :], mask=ok, other=0.0)
            u = u.to(tl.float32)
        for m in tl.static_range(M):
            xm = tl.load(x_ptr + m * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
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
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & col_ok[None, :])


_launches: dict[tuple, Launch] = {}  # per shape: eager calls skip Triton's Python launch path


def _gemv_triton(x, weight, bias, silu_and_mul):
    m, k = x.shape
    n_out = weight.shape[0] // 2 if silu_and_mul else weight.shape[0]
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    assert x.stride(1) == weight.stride(1) == 1 and weight.shape[1] == k
    key = (x.device, x.dtype, m, k, n_out, x.stride(0), weight.stride(0), bias is not None,
           silu_and_mul, interpreting())  # fmt: skip
    launch = _launches.get(key)
    if launch is None:
        launch = _launches[key] = _launch(
            m, k, n_out, x.stride(0), weight.stride(0), bias, silu_and_mul
        )
    launch(x, weight, weight if bias is None else bias, y)
    return y


def _launch(m, k, n_out, stride_x, stride_w, bias, silu_and_mul) -> Launch:
    block_k = min(512, triton.next_power_of_2(k))
    # few columns per program, so the grid has enough programs; at most 16 rows per program
    block_n = max(1, min(16, triton.next_power_of_2(n_out) // _PROGRAMS))
    pdl = pdl_options()
    return Launch(
        _gemv_kernel,
        (triton.cdiv(n_out, block_n), 1, 1),
        num_head=4,  # x, weight, bias, y
        tail=(n_out, k, stride_x, stride_w, n_out),
        constexprs=dict(
            M=m,
            M_P2=triton.next_power_of_2(m),
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            CHUNKS=triton.cdiv(k, block_k),
            HAS_BIAS=bias is not None,
            SILU=silu_and_mul,
            PDL=pdl["PDL"],
        ),  # fmt: skip
        num_warps=4,
        launch_pdl=pdl["launch_pdl"],
    )
