"""Linear layers: merged projections (q|k|v and gate|up run as one matmul) and their split over
tensor-parallel ranks.

Merging saves kernel launches, which is what a decode step is bound by. With T tensor ranks
(layout.py), a column-parallel projection holds 1/T of each merged part's output
rows, in whole heads, and a row-parallel one 1/T of its input columns: the attention and the
MLP between them run on this rank's heads and features alone, and one all-reduce per block
sums the partial outputs. With T = 1 both are the plain projection: the same kernels (the
small-batch kernel included), no collective.

Parameters are created uninitialised: the loader fills every one (see layers/weights.py).

FP8 (quantization.py decides, per model): a block-wise checkpoint's weights load as they are,
FP8 with `weight_scale_inv` [ceil(N / bn), ceil(K / bk)] (a rank holds the scale rows or
columns of its own rows or columns, so its share must be whole blocks); FP8 at load keeps the
model dtype while loading, then `finish_loading` quantises each row (`weight_scale` [N, 1]).
Those per-row FP8 weights take the small-batch kernel's fused paths at one row (plan binds
the scale). At the few rows of fp8.py's FP8 x FP8 dot (per-row and block-wise weights), a
normed projection's norm kernel quantises its output to FP8 as that dot takes it, so the
projection's loop reads FP8 x and quantises nothing (_fp8_norm_first); else fp8_linear
unfused.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ostinato.distributed.parallel import tp_group
from ostinato.kernels import silu_and_mul
from ostinato.kernels.dispatch import interpreting, use_triton
from ostinato.kernels.fp8 import (
    FP8,
    SplitSum,
    fp8_gemv,
    fp8_linear,
    fp8_x_pays,
    quantize_rows,
    x_group,
)
from ostinato.kernels.gemv import gemv, gemv_pays, gemv_plan
from ostinato.kernels.norm import rms_norm_to_fp8
from ostinato.layers.norm import RMSNorm
from ostinato.layers.weights import Loadable, check_shape
from ostinato.layout import rank_share
from ostinato.quantization import building_spec

FUSE = True  # the small-batch fusions around the projections (an A/B switch for benches)


def project(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias): the small-batch kernel where it pays, else cuBLAS."""
    if gemv_pays(x, weight):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def normed_projection(
    proj: nn.Module,
    norm: RMSNorm,
    x: torch.Tensor | SplitSum,
    residual: torch.Tensor | None,
    silu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """proj(norm(x + residual)), with silu (a merged gate|up) SiLU-and-mul after it, and the
    residual stream x + residual as one tensor (x itself without a residual). The small-batch
    kernel where it pays (proj.plan: a Linear's, the norm in its prologue or the norm kernel
    first; a LoRALinear's, the same in a step without adapters and, at one row, with its
    adapter term added); else the norm (with the add, in place) and then proj. x may be
    residual_projection's SplitSum: the FP8 plan's norm kernel sums it, any other way
    settles it first."""
    split = x if isinstance(x, SplitSum) else None
    plan = proj.plan(x if split is None else split.out, norm, residual, silu)
    if split is not None and not (isinstance(plan, partial) and plan.func is _fp8_norm_first):
        x = split.settle()
    if plan is not None:
        return plan(x, proj.weight, proj.bias, residual, norm.weight, None)
    x, residual = norm.stream(x, residual)
    y = proj(x)
    return (silu_and_mul(y) if silu else y), residual


def residual_projection(
    proj: nn.Module, x: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor | SplitSum, torch.Tensor | None]:
    """The residual stream once proj(x) is added to it, as (hidden, residual): hidden +
    residual, or hidden alone when residual is None. The small-batch kernel adds in its
    epilogue, so the next norm reads one tensor; otherwise the add is left to that norm, and
    where proj is FP8 at the FP8 dot's rows, the sum of its K split too (hidden a SplitSum:
    Linear.unsummed)."""
    plan = proj.plan(x, add=residual)
    if plan is not None:
        return plan(x, proj.weight, proj.bias, None, None, residual)[0], None
    unsummed = proj.unsummed(x) if isinstance(proj, Linear) else None
    return (proj(x) if unsummed is None else unsummed), residual


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        spec = building_spec()
        self.quantize_at_load = spec is not None and not spec.from_checkpoint
        self.block = spec.block if spec is not None else None  # None: a scale per row
        # a plain attribute: every eager call asks, and `scale` misses through Module.__getattr__
        self.fp8 = self.block is not None  # the weight is FP8 (per row: from finish_loading)
        self._plans: tuple = (None, None, {})  # plan's: (for which weight and bias, plans)
        dtype = FP8 if self.block else None
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        if self.block:
            bn, bk = self.block
            self.weight_scale_inv = nn.Parameter(
                torch.empty(-(-out_features // bn), -(-in_features // bk), dtype=torch.float32),
                requires_grad=False,
            )

    @property
    def scale(self) -> torch.Tensor | None:
        """float32 weight scales once the weight is FP8 (a block's, or a row's)."""
        scale = getattr(self, "weight_scale_inv", None)
        return scale if scale is not None else getattr(self, "weight_scale", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fp8:
            return fp8_linear(x, self.weight, self.scale, bias, self.block)
        return project(x, self.weight, bias)

    def finish_loading(self) -> None:
        """FP8 at load: the loaded weight becomes FP8 rows and a scale per row."""
        if self.quantize_at_load and not self.fp8:
            weight, scale = quantize_rows(self.weight.data)
            self.weight = nn.Parameter(weight, requires_grad=False)
            self.weight_scale = nn.Parameter(scale, requires_grad=False)
            self.fp8 = True

    def fuses(self, x: torch.Tensor, normed: bool = False) -> bool:
        """Whether the small-batch kernel runs this projection of x, with the ops around it
        (normed: a norm before it): asked by plan, once per kind of input, after its FUSE
        check. FP8 weights only with a scale a row (a block-wise checkpoint's take fp8.py's
        kernel)."""
        return self.block is None and gemv_pays(x, self.weight, normed)

    def unsummed(self, x: torch.Tensor) -> torch.Tensor | SplitSum | None:
        """This projection of x with the sum of its K split left to the reader (a SplitSum;
        the output itself where the launch does not split), where fp8.py's kernel takes x
        through the FP8 dot and no bias follows; else None."""
        if not (FUSE and self.fp8 and self.bias is None and self._quantized_rows(x)):
            return None
        return fp8_gemv(x, self.weight, self.scale, self.block, defer=True)

    def _quantized_rows(self, x: torch.Tensor) -> bool:
        """Whether fp8.py's kernel takes these rows of x through its FP8 x FP8 dot, so a norm
        before it may hand it x quantised (shapes alone decide, as for gemv_pays)."""
        return (
            use_triton(x) and x.dim() == 2 and x.is_contiguous()
            and fp8_x_pays(x.shape[0], x.dtype, self.block)
        )  # fmt: skip

    def plan(
        self,
        x: torch.Tensor,
        norm: RMSNorm | None = None,
        residual: torch.Tensor | None = None,
        silu: bool = False,
        add: torch.Tensor | None = None,
    ) -> Callable | None:
        """Where the small-batch kernel runs this projection of x (fuses), its plan (gemv_plan)
        with norm before it (residual added first), silu after it, or add (the residual
        stream) after that; with a norm the kernel refuses in its prologue but takes without
        one, the norm kernel and then that plan (_norm_first); FP8 weights at the FP8 dot's
        rows with a norm, the norm kernel quantising for it (_fp8_norm_first); else None. Kept
        per kind of input and for this weight and bias (new ones get new plans): an eager step
        asks once a projection, and this key is all it builds before the plan allocates and
        launches."""
        if not FUSE:
            return None
        res = residual if residual is not None else add
        key = (x.shape, x.stride(), x.dtype, x.device, None if norm is None else norm.eps, silu,
               residual is not None, res is not None and (res.shape, res.stride()),
               interpreting())  # fmt: skip
        weight, bias, plans = self._plans
        if weight is not self.weight or bias is not self.bias:
            weight, bias, plans = self._plans = (self.weight, self.bias, {})
        plan = plans.get(key, False)
        if plan is False:
            plan = plans[key] = self._new_plan(x, norm, residual, silu, add)
        return plan

    def _new_plan(self, x, norm, residual, silu, add) -> Callable | None:
        scale = self.scale if self.fp8 else None
        if norm is not None and self.fp8 and self._quantized_rows(x):
            return partial(_fp8_norm_first, norm.eps, x_group(self.block), scale, self.block, silu)
        if self.fuses(x, norm is not None):
            norm_weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
            return gemv_plan(
                x, self.weight, self.bias, silu, residual, norm_weight, eps, add, scale
            )
        # the norm's output is laid out as x where x is contiguous: one plan serves it
        if norm is not None and x.is_contiguous() and self.fuses(x):
            plain = gemv_plan(x, self.weight, self.bias, silu, scale=scale)
            return partial(_norm_first, norm, plain)
        return None


def _fp8_norm_first(eps, group, scale, block, silu, x, weight, bias, residual, norm_weight, add):
    """A plan's call (-> (y, stream)) for FP8 weights at the FP8 dot's rows: the norm kernel
    (residual added first, in place) storing its output quantised per group, then fp8.py's
    kernel on that FP8 x (+ bias), then SiLU-and-mul where silu."""
    q, q_scales = rms_norm_to_fp8(x, residual, norm_weight, eps, group)
    stream = (x.out if isinstance(x, SplitSum) else x) if residual is None else residual
    y = fp8_gemv(q, weight, scale, block, x_scales=q_scales, dtype=stream.dtype)
    if bias is not None:
        y.add_(bias)
    return (silu_and_mul(y) if silu else y), stream


def _norm_first(norm, plain, x, weight, bias, residual, norm_weight, add):
    """A plan's call (-> (y, stream)) as the norm kernel (residual added first, in place),
    then plain: the small-batch kernel without a prologue."""
    x, residual = norm.stream(x, residual)
    return plain(x, weight, bias, None, None, None)[0], residual


class ColumnParallelLinear(Linear):
    """Projections of the same input stacked along the output dimension, each split over the
    tensor ranks in whole units (units[i] rows: a head's head_dim; default 1).

    Part i has full_sizes[i] rows in the checkpoint; this rank holds rows[i] of them (a part
    with fewer units than ranks is shared, as KV heads are: see rank_share), out_sizes[i] rows
    at offsets[i] here. `weight_loader(param, tensor, i)` fills part i from the checkpoint's
    separate projection (weight or bias); shard None: from the whole merged tensor.
    """

    def __init__(
        self,
        in_features: int,
        full_sizes: list[int],
        bias: bool = False,
        units: list[int] | None = None,
    ) -> None:
        tp = tp_group()
        rows = []
        for size, unit in zip(full_sizes, units or [1] * len(full_sizes), strict=True):
            share = rank_share(size // unit, tp.rank, tp.size)
            rows.append(slice(share.start * unit, share.stop * unit))
        out_sizes = [r.stop - r.start for r in rows]
        super().__init__(in_features, sum(out_sizes), bias)
        self.rows, self.out_sizes, self.full_sizes = rows, out_sizes, list(full_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes) + 1)]
        self.full_offsets = [sum(full_sizes[:i]) for i in range(len(full_sizes) + 1)]
        self.unit = {id(self.weight_scale_inv): self.block[0]} if self.block else {}
        if self.block and any(n % self.block[0] for n in out_sizes + list(full_sizes)):
            raise ValueError(
                f"fp8 blocks of {self.block[0]} rows do not tile the projections of "
                f"{full_sizes} rows ({out_sizes} on this tensor rank)"
            )
        for param in self.parameters():
            param.weight_loader = self.load
            param.num_shards = len(out_sizes)
            rows = self.full_offsets[-1] // self.unit.get(id(param), 1)
            param.full_shape = (rows, *param.shape[1:])

    def load(self, param: nn.Parameter, loaded: Loadable, shard: int | None = None) -> None:
        """A weight or bias by rows; a block scale by rows of blocks."""
        unit = self.unit.get(id(param), 1)
        if shard is None:
            check_shape(loaded, param.full_shape)
            for i in range(len(self.full_sizes)):
                start, stop = self.full_offsets[i] // unit, self.full_offsets[i + 1] // unit
                self.load(param, loaded[start:stop], i)
            return
        check_shape(loaded, (self.full_sizes[shard] // unit, *param.shape[1:]))
        here = param.data[self.offsets[shard] // unit : self.offsets[shard + 1] // unit]
        rows = self.rows[shard]
        here.copy_(loaded[rows.start // unit : rows.stop // unit])


class RowParallelLinear(Linear):
    """A projection whose input features (the heads or intermediate features a column-parallel
    projection left on this rank) are split over the tensor ranks: each rank multiplies its
    columns, one all-reduce sums the partial outputs, then the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = tp_group()
        if in_features % tp.size:
            raise ValueError(
                f"{in_features} input features cannot be split evenly over {tp.size} tensor "
                "ranks: choose a tensor_parallel_size that divides them"
            )
        share = rank_share(in_features, tp.rank, tp.size)
        super().__init__(len(share), out_features, bias)
        self.tp, self.cols = tp, slice(share.start, share.stop)
        self.weight.weight_loader = self.load
        self.weight.full_shape = (out_features, in_features)
        if self.block:
            bn, bk = self.block
            if len(share) % bk:
                raise ValueError(
                    f"fp8 blocks of {bk} columns do not tile this tensor rank's {len(share)} "
                    "input features: choose a smaller tensor_parallel_size"
                )
            self.scale.weight_loader = self.load_scale
            self.scale.full_shape = (-(-out_features // bn), -(-in_features // bk))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.matmul(x, self.bias)
        out = self.tp.all_reduce(self.matmul(x, None))
        return out if self.bias is None else out.add_(self.bias)

    def fuses(self, x: torch.Tensor, normed: bool = False) -> bool:
        """Not over several ranks: the residual is added after the all-reduce."""
        return self.tp.size == 1 and super().fuses(x, normed)

    def unsummed(self, x: torch.Tensor) -> torch.Tensor | SplitSum | None:
        """Not over several ranks: the all-reduce sums the output."""
        return super().unsummed(x) if self.tp.size == 1 else None

    def load(self, param: nn.Parameter, loaded: Loadable, shard: int | None = None) -> None:
        check_shape(loaded, param.full_shape)
        param.data.copy_(loaded[:, self.cols])

    def load_scale(self, param: nn.Parameter, loaded: Loadable, shard: int | None = None) -> None:
        check_shape(loaded, param.full_shape)
        bk = self.block[1]
        param.data.copy_(loaded[:, self.cols.start // bk : self.cols.stop // bk])
