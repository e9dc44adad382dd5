"""x @ dequant(w).T for FP8 (float8_e4m3fn) weights with float32 scales: one per output row
(FP8 at load) or one per (block_n x block_k) block (block-wise checkpoints).

Small batches (decode, up to GEMV_ROWS rows) are bound by reading the weights: a Triton kernel
reads the FP8 bytes; K split over programs where the weight has too few rows to fill the GPU
(see gemv_config). One row by FMAs and a sum, the weights widened in registers and x in the
model dtype (weight-only: as exact as the dequantised reference up to the order of the sum);
in a model, one row of per-row scales goes through gemv.py's one-row kernel instead, which
fuses the norm, SiLU and residual around it (layers/linear.py: Linear.plan).
2-32 rows by tl.dot on x padded to 16 or 32 rows. Numerics up to FP8_DOT_ROWS (bfloat16 and
float16 x): x quantised to FP8 e4m3 per (row, group of X_GROUP = 128 columns, narrower where
a block-wise checkpoint's scale blocks are), its scale the group's largest magnitude (at least
1e-12) over 448, each value divided by it, clamped to +-448 and rounded to the nearest even
FP8 value, exactly as torch's (x / s).clamp(-448, 448).to(float8_e4m3fn); the FP8 x FP8
products summed in fp32, times the group's x scale (and the block's weight scale), times the
row's weight scale at the end: the issue's dynamic per-token-group activation scales, the
group being the chunk. Above FP8_DOT_ROWS (and for float32 models) the weight-only dot: x in
the model dtype, the weights widened to it. Larger batches: per-row scales go through
torch._scaled_mm (x quantised per token to FP8, dynamic scales; bfloat16 models, float32 ones
dequantise); block scales through a Triton GEMM that scales each tile. On the CPU: dequantise,
then the same matmul, so CI tests the math.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ostinato.kernels.dispatch import (
    deferred_parts,
    interpreting,
    jit,
    num_sms,
    pdl_options,
    split_counts,
    use_triton,
)
from ostinato.kernels.launch import Launch
from ostinato.kernels.small_batch import (
    GemvConfig,
    arrive,
    gather,
    load_weights,
    split_span,
)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GEMV_ROWS = 32  # up to here _fp8_gemv_kernel; above it _scaled_mm or the tiled GEMM
DOT_ROWS = 2  # from here that kernel's rows go through tl.dot
MAX_SPAN = 4096  # one row: longer weight rows split over programs
_PROGRAMS = 512  # one row: enough programs to keep every SM's memory pipe busy
# Up to this many rows (padded) of half-precision x: x to FP8 per group, an FP8 x FP8 tl.dot;
# above, the weight-only dot. 0 turns it off. On the H100, in llama-3.1-8b's FP8 decode step
# (benchmarks/h100-2026-11-26-s20.md), 1-3% faster than the weight-only dot at batch 4-32.
FP8_DOT_ROWS = 32
X_GROUP = 128  # columns of x that share one activation scale there


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
    else:  # small batches; and large ones in the interpreter, which has no _scaled_mm
        y = fp8_gemv(x, w, scale, block)
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
            EMULATE=interpreting(), num_warps=8, **pdl_options(),
        )  # fmt: skip
    return xq, scale


@jit
def _quantize_tokens_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_x, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
    EMULATE: tl.constexpr, PDL: tl.constexpr,
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
    s, r = activation_scale(tl.max(amax, axis=0))
    tl.store(s_ptr + row, s)
    for c in tl.static_range(CHUNKS):
        kk = c * BLOCK + offs
        v = tl.load(x_ptr + row * stride_x + kk, mask=kk < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * K + kk, quantize_fp8(v, s, r, EMULATE), mask=kk < K)


@jit
def activation_scale(amax):
    """(s, r): an activation scale, the group's largest magnitude (at least 1e-12) over 448,
    divided as torch divides, and 1 / s rounded, for quantize_fp8."""
    s = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
    return s, tl.math.div_rn(1.0, s)


@jit
def quantize_fp8(v, s, r, EMULATE: tl.constexpr):
    """float32 v / s to FP8 e4m3 as torch's (v / s).clamp(-448, 448).to(float8_e4m3fn) does:
    the quotient correctly rounded, then the nearest FP8 value, ties to even.
    The quotient as the hardware's division computes it, without its per-division reciprocal
    and range checks (a tenth of the instructions): v times the rounded reciprocal r, within
    1.5 units in the last place, then one correction by the exact remainder (Markstein's);
    the ranges are safe as s is at least 1e-12 / 448 and |v / s| at most about 448.
    EMULATE (the interpreter, whose conversion misrounds where a value carries into the next
    binade and below 2^-6): round in float32 first, adding and taking away a number whose last
    bit is the FP8 step at that magnitude (2^-9 below 2^-6): the conversion meets FP8 values."""
    q = v * r
    q = tl.fma(tl.fma(-q, s, v), r, q)
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if EMULATE:
        exponent = tl.maximum((q.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
        step = ((exponent - 3) << 23).to(tl.float32, bitcast=True)
        big = step * 12582912.0  # 1.5 * 2^23 steps: its last bit is one step
        q = (q + big) - big
    return q.to(tl.float8e4nv)


def fp8_x_pays(m: int, dtype: torch.dtype, block: tuple[int, int] | None) -> bool:
    """Whether m rows of x in dtype take the FP8 x FP8 dot (x quantised per group of x_group
    columns): 2 to FP8_DOT_ROWS rows (padded to 16 or 32) of half-precision x, groups of at
    least 32 columns (the FP8 MMA's K)."""
    padded = max(16, triton.next_power_of_2(m))
    return (
        m >= DOT_ROWS and padded <= FP8_DOT_ROWS and dtype != torch.float32
        and x_group(block) >= 32
    )  # fmt: skip


def x_group(block: tuple[int, int] | None) -> int:
    """Columns of x per activation scale on the FP8 x FP8 path: X_GROUP, narrower where a
    block-wise checkpoint's scale blocks are (a group lies in one weight block)."""
    return X_GROUP if block is None else math.gcd(X_GROUP, block[1])


def gemv_config(
    m: int,
    n: int,
    k: int,
    block: tuple[int, int] | None,
    sms: int,
    dtype: torch.dtype = torch.bfloat16,
) -> GemvConfig:
    """The launch configuration of _fp8_gemv_kernel, from shapes and x's dtype alone (fixed
    under a graph).

    One row: FMAs, as kernels/gemv.py does for bf16 weights (2.5 TB/s on the H100), the span
    unrolled in chunks so all their loads issue at once; gemv.py lost at K = 8192, so rows
    longer than MAX_SPAN split. Rows of per-row scales whose K is one span of whole chunks of
    2048 columns take those chunks, 4 weight rows a program and 8 warps (the H100 sweep,
    `bench_kernels.py --sections fp8-row-sweep`, benchmarks/h100-2026-11-26-s20.md:
    llama-3.1-8b's qkv 12.4 -> 10.8 µs, gate|up 43.9 -> 40.7, o 7.4 -> 7.6); other spans
    chunks of 512, with weight rows for about _PROGRAMS programs.
    More rows: tl.dot on x padded to 16 or 32 rows, the tensor cores' smallest tile (32 FMAs
    per weight would leave the FMA units short of the memory rate). At the copy rate an SM
    takes in about 13 FP8 weights a cycle and each costs 4-5 instructions in the loop (Triton
    3.9's SASS for sm_90: 4.0 at 16 rows and 5.3 at 32 with 128 weight rows a program, 4.8
    and 6.2 with 64), about 2 of the 4 instructions an SM can issue a cycle: so 128 weight
    rows a program, and K split until there are about two programs per SM, not more (each
    keeps only num_stages - 1 chunks of 16 KB in flight, so a second wave's few programs would
    leave the memory idle), each split at least 4 chunks so the pipeline fills and the fp32
    partials stay small beside the weights.
    Up to FP8_DOT_ROWS (half-precision x; groups of at least 32 columns, the FP8 MMA's K): x
    quantised per (row, group) in the loop, the FP8 weight tile fed to the warpgroup MMA from
    shared memory as it arrives, no widening; float32 models keep the weight-only dot, their exact
    reference. Its launch is the H100 sweep's (`bench_kernels.py --sections fp8-sweep`,
    benchmarks/h100-2026-11-26-s19.md, llama-3.1-8b's projections at 8 and 32 rows): 128
    weight rows a program (256, whose SASS issues fewer instructions per weight, ran 1.1-2x
    slower), 4 warps at 16 rows and 8 at 32, and K split to about two programs per SM. Alone,
    one program per SM ran 2-7% faster; in the step it lost (batch 32: 5.35 ms against 5.00),
    because under PDL the kernel starts while the one before still holds SMs, and a grid of
    one program per SM then stacks two on some SMs and none on others (without PDL one wave
    was as fast as two: benchmarks/h100-2026-11-26-s20.md)."""
    fp8_x = False
    if m < DOT_ROWS:
        rows, block_k, warps, stages = 1, 512, 4, 1
        block_n = max(1, min(16, triton.next_power_of_2(n) // _PROGRAMS))
        split = triton.cdiv(k, MAX_SPAN)
        if block is None and split == 1 and k % 2048 == 0:
            block_k, block_n, warps = 2048, 4, 8
    else:
        rows, block_k, stages = max(16, triton.next_power_of_2(m)), 128, 4
        fp8_x = fp8_x_pays(m, dtype, block)
        block_n, warps = 128, 8 if fp8_x and rows == 32 else 4
        split = max(1, min(2 * sms // triton.cdiv(n, block_n), k // (4 * block_k)))
    if block is not None:  # a chunk lies within one scale block
        block_k = min(block_k, block[1])
    span, split = split_span(k, block_k, split, triton.cdiv(n, block_n))
    return GemvConfig(rows, block_n, block_k, span, split, warps, stages, fp8_x)


@jit
def _bf16_from_fp8(w):
    """FP8 e4m3 -> bfloat16 by moving bits. Triton's conversion takes three conversion
    instructions per pair of weights (e4m3x2 -> f16x2, then f16 -> bf16 each), and an SM
    issues 16 conversions a cycle against the ~13 weights a cycle the copy rate brings it;
    these are integer ops and a packed bf16 multiply. Each 16-bit half takes the byte's
    exponent and mantissa as the low bits of a bf16 exponent and the top of its mantissa: the
    value times 2^-120 (FP8 subnormals land on bf16 subnormals, exactly), which one packed
    multiply by 2^120 restores; adding -0 keeps the sign of zero. (The NaN byte, which
    quantisation never writes, reads as 480.)"""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 a<2>, b<2>, e, z;
        mov.b32 e, 0x7b807b80;
        mov.b32 z, 0x80008000;
        prmt.b32 a0, 0, $2, 0x5140;
        prmt.b32 a1, 0, $2, 0x7362;
        and.b32 b0, a0, 0x7fff7fff;
        and.b32 b1, a1, 0x7fff7fff;
        shr.b32 b0, b0, 4;
        shr.b32 b1, b1, 4;
        lop3.b32 b0, b0, 0x80008000, a0, 0xf8;
        lop3.b32 b1, b1, 0x80008000, a1, 0xf8;
        fma.rn.bf16x2 $0, b0, e, z;
        fma.rn.bf16x2 $1, b1, e, z;
        }
        """,
        constraints="=r,=r,r",
        args=[w.to(tl.uint8, bitcast=True)],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@jit(do_not_specialize=["M"])  # one compiled kernel serves every batch of the same padding
def _fp8_gemv_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, y_ptr, part_ptr, sem_ptr, M, N, K, stride_xm, stride_xs,
    stride_wn, stride_sn, stride_ym, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPAN: tl.constexpr, SPLIT: tl.constexpr, BLOCK_SN: tl.constexpr,
    BLOCK_SK: tl.constexpr, BLOCKWISE: tl.constexpr, F32_DOT: tl.constexpr,
    BIT_MOVES: tl.constexpr, EVEN: tl.constexpr, FP8_X: tl.constexpr, X_FP8: tl.constexpr,
    GROUP: tl.constexpr, DEFER: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """y[:M] for BLOCK_N weight rows over SPAN columns of K (split program_id(1) of SPLIT).

    ROWS == 1: FMAs into a [BLOCK_N, BLOCK_K] tile of terms, summed once after the last
    chunk, the chunks unrolled so all their loads are in flight. Else tl.dot of x's
    [ROWS, BLOCK_K] (rows from M on masked to 0) with the widened weight tile, transposed, in
    a pipelined loop (Triton stages the FP8 tile in shared memory and widens it after
    ldmatrix). BLOCKWISE: chunk k0 lies in scale column k0 // BLOCK_SK, row n in scale row
    n // BLOCK_SN, and each chunk's product is scaled; else one scale per row, applied once at
    the end. F32_DOT: the dot in float32 (float32 models; the interpreter, whose bfloat16 dot
    is wrong); BIT_MOVES: bfloat16 weights by _bf16_from_fp8. EVEN: no masks on the weights.

    FP8_X (tl.dot rows): each GROUP columns of a chunk, x's rows quantised to FP8 with one
    scale each (activation_scale of the group's largest magnitude) and the FP8 weight tile times
    them, transposed ([BLOCK_N, GROUP] x [GROUP, ROWS]: both operands K-major, as the FP8 MMA
    needs, the weights the M side that Hopper's warpgroup MMA wants 64 of); each product is
    scaled by its rows' x scales (and its block's weight scale) into the fp32 sum. F32_DOT
    here: the product of the FP8 values in float32 (the interpreter has no FP8 dot);
    EMULATE: the interpreter's rounding (quantize_fp8). X_FP8: x comes quantised so (FP8, its
    scales at xs_ptr [M, cdiv(K, GROUP)], stride_xs apart): no quantising here; each group's
    scales are loaded a group ahead (loaded in their own step, they were scalar loads outside
    the pipeline that the scaling waited for: Triton 3.9's sm_90 SASS).

    SPLIT > 1: each program stores its fp32 partial in part_ptr [SPLIT, M, N] and counts
    itself in sem_ptr[tile]; the last of a tile's programs sums the partials and stores y
    (kernels/small_batch.py). DEFER: the partials are the output; no count, sum or y (the
    sum is SplitSum's)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, ROWS)
    k_lo = tl.program_id(1) * SPAN
    k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    s_cols = s_ptr + (cols // BLOCK_SN).to(tl.int64) * stride_sn
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    if ROWS == 1:
        # the first chunk of weights, which no kernel writes, is read while the one before
        # drains
        w = load_weights(w_rows, k_lo + k, col_ok, K, EVEN)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        terms = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # summed once, after the last chunk
        for c in tl.static_range(SPAN // BLOCK_K):
            kk = k_lo + c * BLOCK_K + k
            if c > 0:
                w = load_weights(w_rows, kk, col_ok, K, EVEN)
            x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            if BLOCKWISE:
                # a chunk past K (no terms) reads the last scale column, not one past the end
                k0 = tl.minimum(k_lo + c * BLOCK_K, K - 1)
                s = tl.load(s_cols + k0 // BLOCK_SK, mask=col_ok, other=0.0)
                terms += w.to(tl.float32) * x[None, :] * s[:, None]
            else:
                terms += w.to(tl.float32) * x[None, :]
        acc += tl.sum(terms, axis=1)[None, :]
    else:
        if PDL:  # the pipelined loop issues its first loads before the loop: all after this
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        x_rows = x_ptr + rows[:, None] * stride_xm
        if FP8_X:
            acc_t = tl.zeros([BLOCK_N, ROWS], tl.float32)  # y transposed
            k_end = tl.minimum(k_lo + SPAN, K)
            if X_FP8:  # each group's x scales load a group ahead (see above)
                xs_rows = xs_ptr + rows * stride_xs
                xs_next = tl.load(xs_rows + k_lo // GROUP, mask=rows < M, other=0.0)
            for k0 in range(k_lo, k_end, BLOCK_K):
                for g in tl.static_range(BLOCK_K // GROUP):
                    kk = k0 + g * GROUP + tl.arange(0, GROUP)
                    w = load_weights(w_rows, kk, col_ok, K, EVEN)
                    x_ok = (rows < M)[:, None] & (kk < K)[None, :]
                    if X_FP8:
                        xq = tl.load(x_rows + kk[None, :], mask=x_ok, other=0.0)
                        xs = xs_next
                        ahead = k0 + (g + 1) * GROUP
                        xs_ok = tl.where(ahead < k_end, rows < M, False)
                        xs_next = tl.load(xs_rows + ahead // GROUP, mask=xs_ok, other=0.0)
                    else:
                        x = tl.load(x_rows + kk[None, :], mask=x_ok, other=0.0).to(tl.float32)
                        xs, xr = activation_scale(tl.max(tl.abs(x), axis=1))
                        xq = quantize_fp8(x, xs[:, None], xr[:, None], EMULATE)
                    if F32_DOT:
                        part = tl.dot(w.to(tl.float32), tl.trans(xq.to(tl.float32)),
                                      input_precision="ieee")  # fmt: skip
                    else:
                        part = tl.dot(w, tl.trans(xq))
                    if BLOCKWISE:
                        kg = tl.minimum(k0 + g * GROUP, K - 1)  # (as the one-row loop's)
                        s = tl.load(s_cols + kg // BLOCK_SK, mask=col_ok, other=0.0)
                        acc_t += part * xs[None, :] * s[:, None]
                    else:
                        acc_t += part * xs[None, :]
            acc = tl.trans(acc_t)
        else:
            for k0 in range(k_lo, tl.minimum(k_lo + SPAN, K), BLOCK_K):
                kk = k0 + k
                w = load_weights(w_rows, kk, col_ok, K, EVEN)
                x_ok = (rows < M)[:, None] if EVEN else (rows < M)[:, None] & (kk < K)[None, :]
                x = tl.load(x_rows + kk[None, :], mask=x_ok, other=0.0)
                if F32_DOT:
                    x, wt = x.to(tl.float32), tl.trans(w.to(tl.float32))
                elif BIT_MOVES:
                    wt = tl.trans(_bf16_from_fp8(w))
                else:
                    wt = tl.trans(w.to(x.dtype))
                if BLOCKWISE:
                    s = tl.load(s_cols + k0 // BLOCK_SK, mask=col_ok, other=0.0)
                    acc += tl.dot(x, wt, input_precision="ieee") * s[None, :]
                else:
                    acc = tl.dot(x, wt, acc, input_precision="ieee")
    ok = (rows < M)[:, None] & col_ok[None, :]
    if SPLIT > 1:
        parts = part_ptr + rows[:, None] * N + cols[None, :]
        tl.store(parts + tl.program_id(1) * M * N, acc, mask=ok)
        if not DEFER:
            sem = sem_ptr + tl.program_id(0)
            last = arrive(sem, SPLIT)
            ok = tl.where(last, ok, False)  # (the interpreter's ok & last would be integers)
            acc = gather(parts, M * N, ok, SPLIT)
            tl.store(sem, 0, mask=last)
    if not DEFER:
        if not BLOCKWISE:
            acc *= tl.load(s_cols, mask=col_ok, other=0.0)[None, :]
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=ok)  # fmt: skip


class SplitSum(NamedTuple):
    """A projection's output before its K split is summed (fp8_gemv's defer): the fp32
    partials [SPLIT, M, N] in split order; the weight's scale a row [N, 1] (None where the
    partials are scaled already: block-wise weights); and out [M, N] in the model's dtype,
    which settle() fills with what the kernel would have stored. The FP8 norm kernel after
    o and down sums the partials itself (kernels/norm.py: rms_norm_to_fp8), which saves the
    split's tail: a count, the last program's reads and its store, which the next kernel
    waits for."""

    parts: torch.Tensor
    scale: torch.Tensor | None
    out: torch.Tensor

    def settle(self) -> torch.Tensor:
        """out: the partials summed in split order, times the scale, in out's dtype."""
        split, m, n = self.parts.shape
        scaled = self.scale is not None
        key = (split, m, n, scaled, interpreting())
        launch = _settle_launches.get(key)
        if launch is None:  # eager steps settle through a cached launch, as the norms do
            block = min(1024, triton.next_power_of_2(n))
            pdl = pdl_options()
            launch = _settle_launches[key] = Launch(
                _settle_kernel, (m, triton.cdiv(n, block), 1), num_head=3, tail=(m, n),
                constexprs=dict(SPLIT=split, SCALED=scaled, BLOCK=block, PDL=pdl["PDL"]),
                launch_pdl=pdl["launch_pdl"],
            )  # fmt: skip
        launch(self.parts, self.scale if scaled else self.parts, self.out)  # unused without
        return self.out


_settle_launches: dict[tuple, Launch] = {}


def settled(x: torch.Tensor | SplitSum) -> torch.Tensor:
    """x, or a SplitSum's sum."""
    return x.settle() if isinstance(x, SplitSum) else x


@jit
def _settle_kernel(
    part_ptr, s_ptr, out_ptr, M, N, SPLIT: tl.constexpr, SCALED: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    y = settled_row(part_ptr, s_ptr, row, cols, ok, M, N, SPLIT, SCALED)
    tl.store(out_ptr + row * N + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@jit
def settled_row(part_ptr, s_ptr, row, cols, ok, M, N, SPLIT: tl.constexpr, SCALED: tl.constexpr):
    """float32 columns cols of a SplitSum's row as _fp8_gemv_kernel finishes them: the
    partials at part_ptr [SPLIT, M, N] summed in split order, times the scale a row at s_ptr
    [N, 1] where SCALED."""
    y = gather(part_ptr + row * N + cols, M * N, ok, SPLIT)
    if SCALED:
        y *= tl.load(s_ptr + cols, mask=ok, other=0.0)
    return y


_launches: dict[tuple, tuple[Launch, GemvConfig, bool]] = {}  # per shape, as kernels/gemv.py keeps


def fp8_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None = None,
    config: GemvConfig | None = None,
    x_scales: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    defer: bool = False,
) -> torch.Tensor | SplitSum:
    """fp8_linear's small-batch kernel (Triton only), in gemv_config's launch configuration
    or the one given (benchmarks time others). With x_scales, x comes quantised as the FP8
    dot rows take it (FP8, and its scales [M, cdiv(K, x_group(block))]: the norm kernel's,
    kernels/norm.py) and y is in dtype, which it then needs. defer: where the launch splits
    K and there are at least as many rows as output tiles, its SplitSum, the sum left to
    whoever reads it, its partials in dispatch.deferred_parts. The norm kernel that sums it
    reads a row's partials in one program, where the split kernel's last programs read a
    tile's: with fewer rows than tiles that is more to read on fewer SMs (H200, FP8
    llama-3.1-8b, whose o and down have 32 tiles: the step 3.1% faster at 32 rows, its
    kernels 2.5%, benchmarks/h200-2026-11-28-s43.md)."""
    m, k = x.shape
    n = w.shape[0]
    quantized = x_scales is not None
    if quantized and dtype is None:
        raise ValueError("fp8_gemv on x quantised to FP8 needs the output dtype (dtype=)")
    dtype = dtype if quantized else x.dtype
    y = torch.empty(m, n, dtype=dtype, device=x.device)
    if m == 0:
        return y
    xs = x_scales if quantized else x  # unused without
    key = (x.device, dtype, m, n, k, x.stride(0), xs.stride(0), w.stride(0), scale.stride(0),
           block, config, quantized, defer, interpreting(), FP8_DOT_ROWS)  # fmt: skip
    entry = _launches.get(key)
    if entry is None:
        config = config or gemv_config(m, n, k, block, num_sms(x.device, 4), dtype)
        if quantized and not config.fp8_x:
            raise ValueError(f"x quantised to FP8 needs the FP8 x FP8 dot: {config}")
        defer = defer and config.split > 1 and m >= triton.cdiv(n, config.block_n)
        launch = _launch(x, xs, w, scale, block, config, quantized, defer)
        entry = _launches[key] = (launch, config, defer)
    launch, config, defer = entry
    part = sem = x  # unused without a split
    if defer:
        part = deferred_parts(x.device, (config.split, m, n), "fp8 GEMV")
    elif config.split > 1:
        part = torch.empty(config.split, m, n, dtype=torch.float32, device=x.device)
        sem = split_counts(x.device, "fp8 GEMV")
    launch(x, xs, w, scale, y, part, sem)
    return SplitSum(part, None if block else scale, y) if defer else y


def _launch(x, xs, w, scale, block, config: GemvConfig, quantized: bool, defer: bool) -> Launch:
    m, k = x.shape
    n = w.shape[0]
    # no masks where every tile is whole: the loop stops at K, the unrolled span does not
    whole_k = config.span if config.rows == 1 else config.block_k
    group = x_group(block)
    if config.fp8_x and (config.rows == 1 or config.block_k % group):
        raise ValueError(f"FP8 x needs tl.dot rows and chunks of whole groups of {group}: {config}")
    pdl = pdl_options()
    return Launch(
        _fp8_gemv_kernel,
        (triton.cdiv(n, config.block_n), config.split, 1),
        num_head=7,  # x, x's scales, weight, scale, y, partials, counts
        tail=(m, n, k, x.stride(0), xs.stride(0), w.stride(0), scale.stride(0), n),
        constexprs=dict(
            ROWS=config.rows,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            SPAN=config.span,
            SPLIT=config.split,
            BLOCK_SN=block[0] if block else 1,
            BLOCK_SK=block[1] if block else 1,
            BLOCKWISE=block is not None,
            F32_DOT=x.dtype == torch.float32 or interpreting(),
            BIT_MOVES=x.dtype == torch.bfloat16 and not interpreting(),
            EVEN=n % config.block_n == 0 and k % whole_k == 0,
            FP8_X=config.fp8_x,
            X_FP8=quantized,
            GROUP=group,
            DEFER=defer,
            EMULATE=interpreting(),
            PDL=pdl["PDL"],
        ),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=pdl["launch_pdl"],
    )


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
