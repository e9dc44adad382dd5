"""The FP8 small-batch kernel that kernels/fp8.py's _fp8_gemv_kernel replaced (commit cc526a8,
per-row scales only), kept for bench_kernels.py's `fp8` section to time against. Up to 8 rows;
each program reads BLOCK_N weight rows over the whole K, and every row of x takes a full
reduction in a loop over M at run time."""

import torch
import triton
import triton.language as tl

from ostinato.kernels.dispatch import jit, pdl_options

ROWS = 8
_PROGRAMS = 512


@jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, ROWS)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    for c in tl.static_range(CHUNKS):
        kk = c * BLOCK_K + k
        ok = col_ok[:, None] & (kk < K)[None, :]
        w = tl.load(w_rows + kk[None, :], mask=ok, other=0.0).to(tl.float32)
        for m in range(M):
            xm = tl.load(x_ptr + m * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
            row = rows[:, None] == m
            acc = tl.where(row, acc + tl.sum(w * xm[None, :], axis=1)[None, :], acc)
    acc = acc * tl.load(s_ptr + cols, mask=col_ok, other=0.0)[None, :]
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & col_ok[None, :])


def gemv_before(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M <= 8, K] @ (w * scale).T with FP8 w [N, K] and float32 scale [N, 1]."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= ROWS
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_k = min(512, triton.next_power_of_2(k))
    block_n = max(1, min(16, triton.next_power_of_2(n) // _PROGRAMS))
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, scale, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        ROWS=ROWS, BLOCK_N=block_n, BLOCK_K=block_k, CHUNKS=triton.cdiv(k, block_k),
        num_warps=4, **pdl_options(),
    )  # fmt: skip
    return y
