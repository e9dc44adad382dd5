"""Fused mixture-of-experts: every token's top-k experts' SiLU MLPs, weighted and summed.

The (token, choice) pairs are sorted by expert on the device and each expert's run padded to
whole blocks of block_m pairs (`align`); one grouped GEMM reads each active expert's gate|up
rows once per block and applies SiLU-and-mul before storing, a second multiplies by the down
projection and the routing weight; the k choices of a token are then summed (at decode sizes
by the down GEMM itself, _sum_choices, with route and align one program: route_and_align).
The sizes depend only on the token count, never on the routing, so nothing waits for the host
and a step is capturable whole. A pair routed to expert -1 (a padded token) goes to no block:
it costs nothing and adds zero. Large batches take blocks of 16 pairs through tl.dot;
decode batches, whose blocks hold one or a few real pairs, FMAs over blocks of one pair or
tl.dot with K split over programs (`moe_config`), so the few active experts' weights stream
at the copy rate.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ostinato.kernels.dispatch import (
    SPLIT_COUNTS,
    interpreting,
    jit,
    num_sms,
    pdl_options,
    split_counts,
    use_triton,
)

DOT_BLOCK_M = 16  # pairs per block of the tl.dot path: its smallest tile


def route(
    logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    slots: torch.Tensor | None = None,  # [T] KV slots: a token with slot -1 is padding
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in float32, the top k, renormalised to sum to one if asked ->
    (weights float32, ids int32) [T, K]; padded tokens choose expert -1 (nowhere)."""
    if use_triton(logits) and logits.shape[-1] <= 1024:
        return _route_triton(logits, top_k, renormalize, slots)
    return route_torch(logits, top_k, renormalize, slots)


def route_torch(logits, top_k, renormalize, slots=None):
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids = ids.to(torch.int32)
    return weights, ids if slots is None else ids.masked_fill(slots[:, None] < 0, -1)


@jit
def _route_rows(
    logits_ptr, slots_ptr, w_ptr, ids_ptr, t, T, E, stride_l,
    TOP_K: tl.constexpr, K_P2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    RENORM: tl.constexpr, HAS_SLOTS: tl.constexpr,
):  # fmt: skip
    """Tokens t ([BLOCK_T], those from T on skipped): softmax, then the largest probability
    TOP_K times (the lowest expert on a tie), each taken out before the next; stored at
    w_ptr / ids_ptr [T, TOP_K]."""
    e = tl.arange(0, BLOCK_E)
    t_ok = t < T
    ok = t_ok[:, None] & (e < E)[None, :]
    logit = tl.load(logits_ptr + t.to(tl.int64)[:, None] * stride_l + e[None, :], mask=ok,
                    other=-float("inf")).to(tl.float32)  # fmt: skip
    logit = tl.where(t_ok[:, None], logit, 0.0)  # rows past T: finite, never stored
    p = tl.where((e < E)[None, :], tl.exp(logit - tl.max(logit, axis=1)[:, None]), 0.0)
    p = p / tl.sum(p, axis=1)[:, None]
    k = tl.arange(0, K_P2)[None, :]
    weights = tl.zeros([BLOCK_T, K_P2], tl.float32)
    ids = tl.zeros([BLOCK_T, K_P2], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)[:, None]
        pick = tl.min(tl.where(p == best, e[None, :], BLOCK_E), axis=1)[:, None]
        weights = tl.where(k == j, best, weights)
        ids = tl.where(k == j, pick, ids)
        p = tl.where(e[None, :] == pick, -1.0, p)
    if RENORM:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    if HAS_SLOTS:
        ids = tl.where(tl.load(slots_ptr + t, mask=t_ok, other=0)[:, None] < 0, -1, ids)
    out = t.to(tl.int64)[:, None] * TOP_K + k
    tl.store(w_ptr + out, weights, mask=t_ok[:, None] & (k < TOP_K))
    tl.store(ids_ptr + out, ids, mask=t_ok[:, None] & (k < TOP_K))


@jit
def _route_kernel(
    logits_ptr, slots_ptr, w_ptr, ids_ptr, T, E, stride_l,
    TOP_K: tl.constexpr, K_P2: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr,
    HAS_SLOTS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One token a program."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0) + tl.arange(0, 1)
    _route_rows(logits_ptr, slots_ptr, w_ptr, ids_ptr, t, T, E, stride_l, TOP_K, K_P2, 1,
                BLOCK_E, RENORM, HAS_SLOTS)  # fmt: skip


def _route_triton(logits, top_k, renormalize, slots):
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            logits, logits if slots is None else slots, weights, ids, tokens, experts,
            logits.stride(0), TOP_K=top_k, K_P2=triton.next_power_of_2(top_k),
            BLOCK_E=triton.next_power_of_2(experts), RENORM=renormalize,
            HAS_SLOTS=slots is not None, **pdl_options(),
        )  # fmt: skip
    return weights, ids


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # int [T, K]; -1: this choice goes nowhere
    topk_weights: torch.Tensor,  # float32 [T, K]
    configs: tuple[MoeConfig, MoeConfig] | None = None,  # gate|up's and down's launches
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k]
    -> [T, H] in x's dtype. On the GPU in moe_config's launches or those given (benchmarks
    time others)."""
    if use_triton(x):
        return _fused_moe_triton(x, w13, w2, topk_ids, topk_weights, configs)
    return fused_moe_torch(x, w13, w2, topk_ids, topk_weights)


def routed_moe(
    x: torch.Tensor,  # [T, H]
    logits: torch.Tensor,  # [T, E]: the router's
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    slots: torch.Tensor | None = None,  # [T] KV slots: a token with slot -1 is padding
) -> torch.Tensor:
    """A sparse MoE layer from its router's logits: route, then fused_moe. On the GPU at
    decode sizes three kernels: route_and_align, gate|up, down summing each token's choices."""
    if not use_triton(x):
        weights, ids = route_torch(logits, top_k, renormalize, slots)
        return fused_moe_torch(x, w13, w2, ids, weights)
    configs = moe_configs(x.shape[0] * top_k, w13, w2, x.device)
    weights, ids, aligned = route_and_align(logits, top_k, renormalize, slots, configs[0].block_m)
    return _fused_moe_triton(x, w13, w2, ids, weights, configs, aligned)


def fused_moe_torch(x, w13, w2, topk_ids, topk_weights):
    """Every expert over every token, weighted by its routing weight (zero if unchosen)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w2.shape[-1]
    for e in range(w13.shape[0]):
        weight = (topk_weights * (topk_ids == e)).sum(-1, keepdim=True)
        gate_up = F.linear(x, w13[e])
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out += weight * F.linear(h, w2[e]).float()
    return out.to(x.dtype)


FUSED_ALIGN_PAIRS = 256  # up to here (decode batches) one Triton program sorts the pairs
FUSED_ALIGN_EXPERTS = 256


def num_blocks(pairs: int, experts: int, block_m: int) -> int:
    """The blocks any routing of `pairs` pairs fills: each of the at most min(experts, pairs)
    active experts pads its run by at most block_m - 1 slots."""
    return (pairs + min(experts, pairs) * (block_m - 1)) // block_m


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int = DOT_BLOCK_M):
    """Pairs sorted by expert, each expert's run padded to whole blocks.

    Returns sorted_ids (int32 [blocks * block_m]: flat pair index t * K + k, or T * K in
    padding) and block_experts (int32 [blocks]: the expert of each block, -1 for blocks past
    the last). `blocks` bounds every routing, so the shapes depend on T * K alone. Pairs of
    one expert keep their order."""
    n = topk_ids.numel()
    blocks = num_blocks(n, num_experts, block_m)
    if use_triton(topk_ids) and n <= FUSED_ALIGN_PAIRS and num_experts <= FUSED_ALIGN_EXPERTS:
        return _align_triton(topk_ids, num_experts, block_m, blocks)
    return align_torch(topk_ids, num_experts, block_m, blocks)


def align_torch(topk_ids, num_experts, block_m, blocks):
    flat = topk_ids.flatten().long()
    n, device = flat.numel(), flat.device
    size = blocks * block_m
    key = torch.where(flat >= 0, flat, num_experts)  # choices to nowhere sort last
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = torch.cat([ends - padded, torch.full((1,), size, device=device)])
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[sorted_key]
    dest = torch.where(sorted_key < num_experts, starts[sorted_key] + rank, size)
    sorted_ids = torch.full((size + 1,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(blocks, device=device) * block_m
    expert = torch.searchsorted(ends, block_starts, right=True)
    block_experts = torch.where(expert < num_experts, expert, -1).to(torch.int32)
    return sorted_ids[:size], block_experts


@jit
def _align_pairs(
    ids_ptr, sorted_ptr, experts_ptr, n, E, num_blocks,
    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr,
    FILL: tl.constexpr,
):  # fmt: skip
    """align() in one program: counts per expert, each pair's rank among its expert's pairs
    (a running count down the one-hot matrix), its slot, then each block's expert."""
    i = tl.arange(0, BLOCK_N)
    e = tl.load(ids_ptr + i, mask=i < n, other=-1)
    live = (i < n) & (e >= 0)
    ex = tl.arange(0, BLOCK_E)
    onehot = ((e[:, None] == ex[None, :]) & live[:, None]).to(tl.int32)
    counts = tl.sum(onehot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    mine = ex[None, :] == e[:, None]
    rank = tl.sum(tl.where(mine, tl.cumsum(onehot, axis=0), 0), axis=1) - 1
    dest = tl.sum(tl.where(mine, starts[None, :], 0), axis=1) + rank
    for c in tl.static_range(0, FILL, BLOCK_N):
        slot = c + i
        tl.store(sorted_ptr + slot, tl.zeros([BLOCK_N], tl.int32) + n, mask=slot < FILL)
    tl.debug_barrier()  # the padding is written before the pairs land on it
    tl.store(sorted_ptr + dest, i, mask=live)
    b = tl.arange(0, BLOCK_B)
    before = (ends[None, :] <= (b * BLOCK_M)[:, None]) & (ex[None, :] < E)
    expert = tl.sum(before.to(tl.int32), axis=1)
    tl.store(experts_ptr + b, tl.where(expert < E, expert, -1), mask=b < num_blocks)


@jit
def _align_kernel(
    ids_ptr, sorted_ptr, experts_ptr, n, E, num_blocks,
    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr,
    FILL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _align_pairs(ids_ptr, sorted_ptr, experts_ptr, n, E, num_blocks, BLOCK_N, BLOCK_E, BLOCK_B,
                 BLOCK_M, FILL)  # fmt: skip


def _align_triton(topk_ids, num_experts, block_m, blocks):
    sorted_ids, block_experts = _aligned_outputs(blocks, block_m, topk_ids.device)
    _align_kernel[(1,)](
        topk_ids.reshape(-1), sorted_ids, block_experts, topk_ids.numel(), num_experts, blocks,
        **_align_sizes(topk_ids.numel(), num_experts, block_m, blocks), num_warps=8,
        **pdl_options(),
    )  # fmt: skip
    return sorted_ids, block_experts


def _aligned_outputs(blocks, block_m, device):
    return (torch.empty(blocks * block_m, dtype=torch.int32, device=device),
            torch.empty(blocks, dtype=torch.int32, device=device))  # fmt: skip


def _align_sizes(n, num_experts, block_m, blocks):
    return {"BLOCK_N": max(16, triton.next_power_of_2(n)),
            "BLOCK_E": max(16, triton.next_power_of_2(num_experts)),
            "BLOCK_B": max(16, triton.next_power_of_2(blocks)), "BLOCK_M": block_m,
            "FILL": blocks * block_m}  # fmt: skip


def route_and_align(
    logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    slots: torch.Tensor | None,
    block_m: int,
    num_warps: int | None = None,  # the one program's; None: route_warps' (benchmarks time others)
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """route() and then align() of its choices -> (weights, ids, (sorted_ids, block_experts));
    one Triton program for both where align takes one (decode batches)."""
    tokens, experts = logits.shape
    n = tokens * top_k
    fused = use_triton(logits) and 0 < n <= FUSED_ALIGN_PAIRS and experts <= FUSED_ALIGN_EXPERTS
    if not fused:
        weights, ids = route(logits, top_k, renormalize, slots)
        return weights, ids, align(ids, experts, block_m)
    device = logits.device
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    blocks = num_blocks(n, experts, block_m)
    sorted_ids, block_experts = _aligned_outputs(blocks, block_m, device)
    sizes = _align_sizes(n, experts, block_m, blocks)
    _route_align_kernel[(1,)](
        logits, logits if slots is None else slots, weights, ids, sorted_ids, block_experts,
        tokens, experts, logits.stride(0), blocks, TOP_K=top_k,
        K_P2=triton.next_power_of_2(top_k), RENORM=renormalize, HAS_SLOTS=slots is not None,
        BLOCK_T=min(triton.next_power_of_2(tokens), max(1, ROUTE_TILE // sizes["BLOCK_E"])),
        **sizes, num_warps=num_warps or route_warps(tokens), **pdl_options(),
    )  # fmt: skip
    return weights, ids, (sorted_ids, block_experts)


def route_warps(tokens: int) -> int:
    """The warps of route_and_align's one program. Its chain of small reductions (two a choice)
    is latency: in one warp they stay in registers and shuffles, in more they cross shared
    memory. On the H100 (bench_kernels.py --sections moe-route, qwen3-30b-a3b's 128 experts,
    top 8; benchmarks/h100-2026-11-27-s29.md) one token took 2.9 µs in one warp against 5.4 in
    eight; 8 and 32 tokens, whose one-hot sort is wider, 6.4 and 17.1 µs in eight against
    10.1 and 87 in one."""
    return 1 if tokens == 1 else 8


ROUTE_TILE = 4096  # logits one step of the fused route holds: 16 a thread of 8 warps


@jit
def _route_align_kernel(
    logits_ptr, slots_ptr, w_ptr, ids_ptr, sorted_ptr, experts_ptr, T, E, stride_l, num_blocks,
    TOP_K: tl.constexpr, K_P2: tl.constexpr, RENORM: tl.constexpr, HAS_SLOTS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """route_and_align in one program: the tokens' choices, BLOCK_T tokens a step, then the
    sort of their pairs, which reads the choices back."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for t0 in range(0, T, BLOCK_T):
        _route_rows(logits_ptr, slots_ptr, w_ptr, ids_ptr, t0 + tl.arange(0, BLOCK_T), T, E,
                    stride_l, TOP_K, K_P2, BLOCK_T, BLOCK_E, RENORM, HAS_SLOTS)  # fmt: skip
    tl.debug_barrier()  # every choice stored before the sort reads them
    _align_pairs(ids_ptr, sorted_ptr, experts_ptr, T * TOP_K, E, num_blocks, BLOCK_N, BLOCK_E,
                 BLOCK_B, BLOCK_M, FILL)  # fmt: skip


class MoeConfig(NamedTuple):
    """A launch of _moe_gemm_kernel. The two GEMMs of a call share block_m (align's)."""

    block_m: int  # pairs per block: 1 (FMAs) or DOT_BLOCK_M (tl.dot)
    block_n: int  # output columns per program (of each of gate and up when gated)
    block_k: int  # K columns per step
    split: int  # programs along K; the last of a tile to finish sums their fp32 partials
    num_warps: int
    num_stages: int


# The launch of each batch size (moe_config), from bench_kernels.py's moe and moe-sweep
# sections on the H100 (qwen3-30b-a3b's experts at 1, 8 and 32 tokens; benchmarks/
# h100-2026-11-25-s18.md): gate|up's FMAs at 8 x 512 took 19.2 / 110.5 µs at 1 / 8 tokens
# against 20.6 / 125.6 at 8 x 256; down's best was 16 x 256 at both (10.3 / 56.2 µs).
FMA_PAIRS = 64  # up to here (8 tokens of top-8) blocks of one pair, by FMAs
FMA_BLOCK_K = 256
FMA_BLOCK_K_GATED = 512
FMA_WARPS = 4
FMA_THREAD_LOADS = 512  # weight bytes a thread's unrolled span loads at once: 128 registers
MAX_SPAN = 4096  # FMAs: longer rows split over programs
FMA_PROGRAMS = 512  # FMAs: enough programs to keep every SM's memory pipe busy
SMALL_PAIRS = 256  # up to here (32 tokens) tl.dot with SMALL_DOT, K split to fill the GPU
SMALL_DOT = MoeConfig(DOT_BLOCK_M, 64, 128, 1, 4, 4)
# up to here the down GEMM sums each token's choices itself (_sum_choices): no zeroed output,
# no sum kernel; above, its blocks cover most tokens' choices at once and the sum kernel stays
SUM_PAIRS = SMALL_PAIRS
LARGE_DOT = MoeConfig(DOT_BLOCK_M, 64, 64, 1, 4, 3)  # every batch's launch before issue 21


@functools.cache
def moe_config(
    pairs: int, n: int, k: int, gated: bool, itemsize: int, experts: int, sms: int
) -> MoeConfig:
    """The launch of one grouped GEMM over `pairs` (token, choice) pairs of n output columns
    (of each of gate and up when gated), K = k and weights of `itemsize` bytes, from shapes
    alone (fixed under a graph, whatever the routing); block_m follows from pairs alone, so
    both GEMMs of a call agree.

    A decode batch's experts hold one or a few pairs each (top-8 of 128 experts: 1.2 pairs
    an active expert at 8 tokens, 2.3 at 32), so tl.dot's 16-row tile is mostly padding, and
    the old launch's grid (8 experts x 12 column tiles for gate|up at one token) left SMs
    idle, each program's K loop serial. Up to FMA_PAIRS pairs: a block per pair, by FMAs as
    fp8.py's one-row kernel (an expert's blocks are neighbours in the grid, so its second
    pair's weights come from L2): few weight rows per program, about FMA_PROGRAMS programs,
    each span unrolled so all its loads are in flight, as many rows as FMA_THREAD_LOADS a
    thread holds (more spill registers). Up to SMALL_PAIRS: tl.dot, K split until there are
    about two programs per SM (each split at least 4 steps long). Above: the old launch,
    whose grid is large enough."""
    rows = 2 if gated else 1
    if pairs <= FMA_PAIRS:
        widest = FMA_BLOCK_K_GATED if gated else FMA_BLOCK_K
        block_k = min(widest, max(16, triton.next_power_of_2(k)))
        split = triton.cdiv(k, MAX_SPAN)
        span = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
        fits = max(1, FMA_THREAD_LOADS * 32 * FMA_WARPS // (rows * span * itemsize))
        wide = max(4, triton.next_power_of_2(pairs * n) // FMA_PROGRAMS)
        block_n = min(16, 1 << (fits.bit_length() - 1), wide)
        config = MoeConfig(1, block_n, block_k, split, FMA_WARPS, 1)
    else:
        base = SMALL_DOT if pairs <= SMALL_PAIRS else LARGE_DOT
        block_n = min(base.block_n, max(16, triton.next_power_of_2(n)))
        block_k = min(base.block_k, max(16, triton.next_power_of_2(k)))
        split = 1
        if pairs <= SMALL_PAIRS:  # about one block an active expert at these sizes
            programs = min(experts, pairs) * triton.cdiv(n, block_n)
            split = max(1, min(2 * sms // programs, k // (4 * block_k)))
        config = base._replace(block_n=block_n, block_k=block_k, split=split)
    tiles = num_blocks(pairs, experts, config.block_m) * triton.cdiv(n, config.block_n)
    return config if tiles <= SPLIT_COUNTS else config._replace(split=1)


def _span(k: int, config: MoeConfig) -> tuple[int, int]:
    """(K columns per split, a multiple of block_k; the splits that takes)."""
    span = triton.cdiv(triton.cdiv(k, config.split), config.block_k) * config.block_k
    return span, triton.cdiv(k, span)


@jit(do_not_specialize=["num_pairs"])  # one compiled kernel serves every batch size
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ptr, experts_ptr, weights_ptr, part_ptr, sem_ptr,
    ids_ptr, rows_ptr, counts_ptr,
    N, K, num_pairs, stride_am, stride_we, stride_wn, stride_om,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr,
    SPLIT: tl.constexpr, SUM_K: tl.constexpr, K_P2: tl.constexpr, F32_DOT: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One block of pairs of one expert x BLOCK_N output columns x SPAN columns of K (split
    program_id(2) of SPLIT): out[pair] = a[pair // A_ROW_DIV] @ w[e].T; GATED: silu(gate) *
    up of rows n and N + n; WEIGHTED: times the pair's routing weight. Blocks of no expert do
    nothing.

    BLOCK_M >= 16: tl.dot in a pipelined K loop (F32_DOT: in float32, for float32 models and
    the interpreter, whose bfloat16 dot is wrong). BLOCK_M == 1: FMAs, the pair's products
    with each [BLOCK_N, BLOCK_K] weight tile added into a tile of terms, summed once after
    the last chunk, the chunks unrolled so all their loads are in flight.

    SPLIT > 1: each program stores its fp32 partials (gate and up) in part_ptr [SPLIT, pairs,
    N or 2N] and counts itself in sem_ptr[tile]; the last of a tile's programs sums the
    partials in split order (the same sum on every run), resets the count to 0 for the next
    launch, and finishes the tile. No program waits for another (fp8.py's GEMV does the
    same).

    SUM_K > 0 (the down GEMM at decode sizes): out is [T, N], each token's sum over its
    SUM_K choices (ids_ptr [T, SUM_K]); see _sum_choices. The programs of block 0 write zero
    rows for the tokens routed nowhere (a graph's padding), which no pair sums into."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if SUM_K > 0:
        _zero_unrouted(ids_ptr, out_ptr, num_pairs // SUM_K, N, stride_om, SUM_K, K_P2, BLOCK_N)
    e = tl.load(experts_ptr + tl.program_id(0))
    if e >= 0:
        pairs = tl.load(sorted_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
        pair_ok = pairs < num_pairs
        a_rows = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * stride_am
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w_cols = w_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64) * stride_wn
        up_rows = N * stride_wn
        k_lo = tl.program_id(2) * SPAN
        k = tl.arange(0, BLOCK_K)
        if BLOCK_M >= 16:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(k_lo, tl.minimum(k_lo + SPAN, K), BLOCK_K):
                kk = k0 + k
                a = tl.load(a_rows + kk[None, :], mask=pair_ok[:, None] & (kk < K)[None, :],
                            other=0.0)  # fmt: skip
                w_ok = (kk < K)[:, None] & col_ok[None, :]
                w = tl.load(w_cols[None, :] + kk[:, None], mask=w_ok, other=0.0)
                acc = _dot(a, w, acc, F32_DOT)
                if GATED:
                    u = tl.load(w_cols[None, :] + up_rows + kk[:, None], mask=w_ok, other=0.0)
                    up = _dot(a, u, up, F32_DOT)
        else:  # BLOCK_M == 1: an expert's block holds one real pair (no padding)
            pair = tl.load(sorted_ptr + tl.program_id(0))
            a_row = a_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_am
            # the pair's row is loaded as a whole [BLOCK_N, BLOCK_K] tile (repeats come from
            # L1), in the weight tile's layout: a row would be moved into it through shared
            # memory at every chunk, a barrier the next chunk's loads would wait behind
            no_cols = tl.zeros([BLOCK_N], tl.int32)[:, None]
            terms = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            up_terms = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for c in tl.static_range(SPAN // BLOCK_K):
                kk = k_lo + c * BLOCK_K + k
                a = tl.load(a_row + no_cols + kk[None, :], mask=(kk < K)[None, :], other=0.0)
                a = a.to(tl.float32)
                w_ok = col_ok[:, None] & (kk < K)[None, :]
                w = tl.load(w_cols[:, None] + kk[None, :], mask=w_ok, other=0.0)
                terms += a * w.to(tl.float32)
                if GATED:
                    u = tl.load(w_cols[:, None] + up_rows + kk[None, :], mask=w_ok, other=0.0)
                    up_terms += a * u.to(tl.float32)
            acc = tl.sum(terms, axis=1)[None, :]
            up = tl.sum(up_terms, axis=1)[None, :]
        ok = pair_ok[:, None] & col_ok[None, :]
        if SPLIT > 1:
            width = 2 * N if GATED else N
            parts = part_ptr + pairs.to(tl.int64)[:, None] * width + cols[None, :]
            split_stride = num_pairs.to(tl.int64) * width
            mine = parts + tl.program_id(2) * split_stride
            tl.store(mine, acc, mask=ok)
            if GATED:
                tl.store(mine + N, up, mask=ok)
            tl.debug_barrier()  # every thread's partial stored before the count releases them
            sem = sem_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            last = tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
            ok = tl.where(last, ok, False)  # (the interpreter's ok & last would be integers)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for split in tl.static_range(SPLIT):  # .cg: from L2, where the other SMs wrote
                acc += tl.load(parts + split * split_stride, mask=ok, other=0.0,
                               cache_modifier=".cg")  # fmt: skip
                if GATED:
                    up += tl.load(parts + split * split_stride + N, mask=ok, other=0.0,
                                  cache_modifier=".cg")  # fmt: skip
            tl.store(sem, 0, mask=last)
        if GATED:
            acc = acc * tl.sigmoid(acc) * up
        if WEIGHTED:
            acc *= tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0)[:, None]
        if SUM_K > 0:
            _sum_choices(acc, pairs, ok, cols, col_ok, N, ids_ptr, rows_ptr, counts_ptr,
                         out_ptr, stride_om, SUM_K, K_P2)  # fmt: skip
        else:
            out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)


@jit
def _sum_choices(
    acc, pairs, ok, cols, col_ok, N, ids_ptr, rows_ptr, counts_ptr, out_ptr, stride_om,
    SUM_K: tl.constexpr, K_P2: tl.constexpr,
):  # fmt: skip
    """The down GEMM's epilogue at decode sizes, in place of a zeroed [pairs, N] output and
    a sum kernel: the block's weighted pair rows (acc, where ok) are stored in fp32 at
    rows_ptr [pairs, N], and each pair counts itself at its (token, column tile) count; the
    last of a token's routed choices to arrive (choices to -1 have no block and are not
    waited for) sums the token's rows in choice order, the same sum on every run, stores it
    in out [T, N] and resets the count for the next launch (the split counts' scheme)."""
    tl.store(rows_ptr + pairs.to(tl.int64)[:, None] * N + cols[None, :], acc, mask=ok)
    tl.debug_barrier()  # every thread's rows stored before the count releases them
    mine = tl.max(ok.to(tl.int32), axis=1) > 0  # the pairs this program finished
    token = pairs // SUM_K
    first = token.to(tl.int64) * SUM_K  # the token's first pair
    k = tl.arange(0, K_P2)[None, :]
    routed = tl.load(ids_ptr + first[:, None] + k, mask=mine[:, None] & (k < SUM_K),
                     other=-1) >= 0  # fmt: skip
    count = counts_ptr + token * tl.num_programs(1) + tl.program_id(1)
    arrived = tl.atomic_add(count, 1, mask=mine, sem="acq_rel", scope="gpu")
    last = mine & (arrived == tl.sum(routed.to(tl.int32), axis=1) - 1)
    total = tl.zeros_like(acc)
    for j in tl.static_range(SUM_K):  # .cg: from L2, where the other SMs wrote
        use = last & (tl.sum(tl.where(routed & (k == j), 1, 0), axis=1) > 0)
        total += tl.load(rows_ptr + (first + j)[:, None] * N + cols[None, :],
                         mask=use[:, None] & col_ok[None, :], other=0.0,
                         cache_modifier=".cg")  # fmt: skip
    out = out_ptr + token.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=last[:, None] & col_ok[None, :])
    tl.store(count, 0, mask=last)


@jit
def _zero_unrouted(
    ids_ptr, out_ptr, T, N, stride_om,
    SUM_K: tl.constexpr, K_P2: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """In the programs of block 0 (and the first split): zero out's rows, in the program's
    column tile, of the tokens whose every choice is -1."""
    if (tl.program_id(0) == 0) & (tl.program_id(2) == 0):
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, K_P2)[None, :]
        for t0 in range(0, T, 16):
            t = t0 + tl.arange(0, 16)
            ids = tl.load(ids_ptr + t[:, None] * SUM_K + k,
                          mask=(t < T)[:, None] & (k < SUM_K), other=-1)  # fmt: skip
            unrouted = (tl.max(ids, axis=1) < 0) & (t < T)
            zeros = tl.zeros([16, BLOCK_N], out_ptr.dtype.element_ty)
            tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_om + cols[None, :], zeros,
                     mask=unrouted[:, None] & (cols < N)[None, :])  # fmt: skip


@jit
def _dot(a, w, acc, F32_DOT: tl.constexpr):
    if F32_DOT:
        acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w, acc)
    return acc


def moe_gemm(
    a: torch.Tensor,  # [rows, K]: tokens (gate|up) or pairs (down)
    w: torch.Tensor,  # [E, N or 2N, K]
    out: torch.Tensor,  # [pairs, N]: the pairs of no block are left as they were; [T, N] summed
    sorted_ids: torch.Tensor,
    block_experts: torch.Tensor,  # align's, with config.block_m
    weights: torch.Tensor | None,  # float32 [pairs]: times each pair's routing weight
    a_row_div: int,  # pair p reads row p // a_row_div of a
    gated: bool,
    config: MoeConfig,
    sum_ids: torch.Tensor | None = None,  # int [T, K]: out is each token's sum over its choices
) -> None:
    """One grouped GEMM of fused_moe (Triton only), in the launch given."""
    n = out.shape[1]
    pairs = out.shape[0] if sum_ids is None else sum_ids.numel()
    k = a.shape[1]
    span, split = _span(k, config)
    blocks, tiles = block_experts.shape[0], triton.cdiv(n, config.block_n)
    assert config.block_m == 1 or config.block_m >= DOT_BLOCK_M
    assert sorted_ids.shape[0] == blocks * config.block_m
    part = sem = rows = counts = out  # unused without a split, without a sum
    if split > 1:
        assert blocks * tiles <= SPLIT_COUNTS, "a split launch counts each tile"
        part = torch.empty(split, pairs, 2 * n if gated else n, dtype=torch.float32,
                           device=out.device)  # fmt: skip
        sem = split_counts(out.device, "MoE GEMM")
    if sum_ids is not None:
        assert sums_fit(sum_ids.shape[0], blocks, tiles), "a summing launch counts each row"
        rows = torch.empty(pairs, n, dtype=torch.float32, device=out.device)
        counts = split_counts(out.device, "MoE GEMM")[blocks * tiles :]  # past the split's
    grid = (blocks, tiles, split)
    _moe_gemm_kernel[grid](
        a, w, out, sorted_ids, block_experts, out if weights is None else weights, part, sem,
        out if sum_ids is None else sum_ids, rows, counts,
        n, k, pairs, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROW_DIV=a_row_div, GATED=gated, WEIGHTED=weights is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPAN=span,
        SPLIT=split, SUM_K=0 if sum_ids is None else sum_ids.shape[1],
        K_P2=1 if sum_ids is None else triton.next_power_of_2(sum_ids.shape[1]),
        F32_DOT=a.dtype == torch.float32 or interpreting(),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_options(),
    )  # fmt: skip


def sums_fit(tokens: int, blocks: int, tiles: int) -> bool:
    """Whether the counts hold a summing launch's: its split's (blocks x tiles), then one per
    token and column tile."""
    return (blocks + tokens) * tiles <= SPLIT_COUNTS


def moe_configs(
    pairs: int, w13: torch.Tensor, w2: torch.Tensor, device: torch.device
) -> tuple[MoeConfig, MoeConfig]:
    """moe_config of the gate|up GEMM and of the down GEMM."""
    experts, hidden, inter = w2.shape
    sms, size = num_sms(device, 4), w13.element_size()
    return (
        moe_config(pairs, inter, hidden, True, size, experts, sms),
        moe_config(pairs, hidden, inter, False, size, experts, sms),
    )


def _fused_moe_triton(x, w13, w2, topk_ids, topk_weights, configs=None, aligned=None):
    tokens, top_k = topk_ids.shape
    pairs = tokens * top_k
    inter, hidden = w2.shape[2], w2.shape[1]
    if pairs == 0:
        return torch.zeros(tokens, hidden, dtype=x.dtype, device=x.device)
    assert x.stride(1) == w13.stride(2) == w2.stride(2) == 1
    up_config, down_config = configs or moe_configs(pairs, w13, w2, x.device)
    assert up_config.block_m == down_config.block_m
    sorted_ids, block_experts = aligned or align(topk_ids, w13.shape[0], up_config.block_m)
    weights = topk_weights.reshape(-1).float().contiguous()
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    moe_gemm(x, w13, h, sorted_ids, block_experts, None, top_k, True, up_config)
    tiles = triton.cdiv(hidden, down_config.block_n)
    if pairs <= SUM_PAIRS and sums_fit(tokens, block_experts.shape[0], tiles):
        out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
        moe_gemm(h, w2, out, sorted_ids, block_experts, weights, 1, False, down_config,
                 sum_ids=topk_ids.int().contiguous())  # fmt: skip
        return out
    # unwritten pairs (routed nowhere) must add zero
    out = torch.zeros(pairs, hidden, dtype=x.dtype, device=x.device)
    moe_gemm(h, w2, out, sorted_ids, block_experts, weights, 1, False, down_config)
    return out.view(tokens, top_k, hidden).sum(1)  # float32 accumulation, one kernel
