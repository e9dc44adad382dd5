"""RMSNorm, and the fused residual-add + RMSNorm used between layers; for an FP8 projection of
a few rows, the same with its output quantised to FP8 as the FP8 x FP8 dot takes it."""

import torch
import triton
import triton.language as tl

from ostinato.kernels.dispatch import interpreting, jit, pdl_options, use_triton
from ostinato.kernels.fp8 import FP8, SplitSum, activation_scale, quantize_fp8, settled_row
from ostinato.kernels.launch import Launch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return _rms_norm_triton(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: residual += x, then x = rms_norm(residual)."""
    if use_triton(x):
        return _fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_torch(x, residual, weight, eps)


def rms_norm_to_fp8(
    x: torch.Tensor | SplitSum,  # [M, n]
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x) (with residual: residual += x in place, then rms_norm(residual)), rounded
    to x's dtype as the norm kernel stores it, then quantised to FP8 per group of `group`
    columns as the FP8 dot rows quantise x (fp8.py: activation_scale, quantize_fp8) -> (FP8
    [M, n], float32 scales [M, cdiv(n, group)]),
    in one kernel (Triton only): what fp8_gemv's FP8 dot rows take. x may be a SplitSum with
    a residual: the kernel sums it as it would have been settled, and adds that."""
    split = None
    if isinstance(x, SplitSum):  # summed here with a residual; without one x is the stream
        split, x = (x, x.out) if residual is not None else (None, x.settle())
    m, n = x.shape
    q = torch.empty(m, n, dtype=FP8, device=x.device)
    s = torch.empty(m, triton.cdiv(n, group), dtype=torch.float32, device=x.device)
    x3 = x.view(m, 1, n)
    _launch(x3, None if residual is None else residual.view(-1, n), x3, weight, eps, (q, s, group),
            split)  # fmt: skip
    return q, s


def rms_norm_torch(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_add_rms_norm_torch(x, residual, weight, eps) -> None:
    residual.add_(x)
    x.copy_(rms_norm_torch(residual, weight, eps))


@jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, out_ptr, weight_ptr, q_ptr, s_ptr, ws_ptr, eps, n, inner,
    stride_x0, stride_x1, stride_r0, stride_o0, stride_o1,
    ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, SPLIT: tl.constexpr,
    SCALED: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One row per program; a row is x[row // inner, row % inner, :] so that per-head norms
    work on strided views of a fused qkv projection. With ADD_RESIDUAL, residual += x first
    and the norm reads the sum as stored, so it sees exactly what the next layer adds to.
    GROUP (rows of [M, n], inner 1): the output as stored, quantised to FP8 per group of GROUP
    columns (fp8.py's activation_scale and quantize_fp8) into q_ptr [M, n] and its scales
    into s_ptr [M, cdiv(n, GROUP)], instead of out_ptr.
    SPLIT (rows of [M, n], inner 1): x is a SplitSum's partials at x_ptr [SPLIT, M, n] (with
    its scale a row at ws_ptr where SCALED), summed as settled and rounded to out's dtype."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    outer, head = row // inner, row % inner
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x_ptrs = x_ptr + outer * stride_x0 + head * stride_x1 + cols
    if SPLIT:
        x = settled_row(x_ptr, ws_ptr, row, cols, mask, tl.num_programs(0), n, SPLIT, SCALED)
        x = x.to(out_ptr.dtype.element_ty).to(tl.float32)
    else:
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        r_ptrs = residual_ptr + row * stride_r0 + cols
        r = (x + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(r_ptrs.dtype.element_ty)
        tl.store(r_ptrs, r, mask=mask)
        x = r.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd * w).to(out_ptr.dtype.element_ty)
    if GROUP:
        groups = tl.reshape(y.to(tl.float32), [BLOCK // GROUP, GROUP])
        scale, inverse = activation_scale(tl.max(tl.abs(groups), axis=1))
        q = quantize_fp8(groups, scale[:, None], inverse[:, None], EMULATE)
        tl.store(q_ptr + row * n + cols, tl.reshape(q, [BLOCK]), mask=mask)
        g = tl.arange(0, BLOCK // GROUP)
        tl.store(s_ptr + row * tl.cdiv(n, GROUP) + g, scale, mask=g * GROUP < n)
    else:
        tl.store(out_ptr + outer * stride_o0 + head * stride_o1 + cols, y, mask=mask)


_launches: dict[tuple, Launch] = {}  # eager calls skip Triton's Python launch path


def _launch(x3, residual, out3, weight, eps, fp8_out=None, split: SplitSum | None = None) -> None:
    """x3, out3: [outer, inner, n] with unit stride in n; residual: [outer * inner, n] or None;
    fp8_out: (q, s, group) of rms_norm_to_fp8, or None; split: the SplitSum x3 is the out of."""
    outer, inner, n = x3.shape
    rows = outer * inner
    if rows == 0:
        return
    assert x3.stride(2) == out3.stride(2) == 1
    res = x3 if residual is None else residual
    q, s, group = fp8_out or (x3, x3, 0)  # unused without
    parts, scale = (x3, None) if split is None else (split.parts, split.scale)
    tail = (eps, n, inner, x3.stride(0), x3.stride(1), res.stride(0), out3.stride(0),
            out3.stride(1))  # fmt: skip
    splits = 0 if split is None else len(parts)
    key = (tail, residual is not None, group, splits, scale is not None, interpreting())
    launch = _launches.get(key)
    if launch is None:
        block = max(triton.next_power_of_2(n), group)
        pdl = pdl_options()
        launch = _launches[key] = Launch(
            _rms_norm_kernel, (rows, 1, 1), num_head=7, tail=tail,
            constexprs=dict(ADD_RESIDUAL=residual is not None, BLOCK=block, GROUP=group,
                            SPLIT=splits, SCALED=scale is not None, EMULATE=interpreting(),
                            PDL=pdl["PDL"]),
            num_warps=min(16, max(1, block // 256)), launch_pdl=pdl["launch_pdl"],
        )  # fmt: skip
    launch.run((rows, 1, 1), parts, res, out3, weight, q, s, x3 if scale is None else scale)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """[..., n] as [outer, inner, n] without copying the 2-d and 3-d cases models pass."""
    if x.dim() == 3:
        return x
    return x.reshape(-1, 1, x.shape[-1])


def _rms_norm_triton(x, weight, eps):
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(_as_3d(x), None, _as_3d(out), weight, eps)
    return out


def _fused_add_rms_norm_triton(x, residual, weight, eps) -> None:
    n = x.shape[-1]
    x2, r2 = x.view(-1, 1, n), residual.view(-1, n)
    assert r2.stride(1) == 1
    _launch(x2, r2, x2, weight, eps)
