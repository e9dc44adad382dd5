"""Fused mixture-of-experts: every token's top-k experts' SiLU MLPs, weighted and summed.

The (token, choice) pairs are sorted by expert on the device and each expert's run padded to
whole BLOCK_M blocks (`align`); one grouped GEMM reads each active expert's gate|up rows once
per block and applies SiLU-and-mul before storing, a second multiplies by the down projection
and the routing weight; the k choices of a token are then summed. The sizes depend only on the
token count, never on the routing, so nothing waits for the host and a step is capturable whole.
A pair routed to expert -1 (a padded token) goes to no block: it costs nothing and adds zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ostinato.kernels.dispatch import jit, pdl_options, use_triton

BLOCK_M = 16  # pairs per block: tl.dot's smallest tile


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
def _route_kernel(
    logits_ptr, slots_ptr, w_ptr, ids_ptr, E, stride_l,
    TOP_K: tl.constexpr, K_P2: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr,
    HAS_SLOTS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One token: softmax, then the largest probability TOP_K times (the lowest expert on a
    tie), each taken out before the next."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    logit = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=-float("inf")).to(tl.float32)
    p = tl.where(ok, tl.exp(logit - tl.max(logit, axis=0)), 0.0)
    p = p / tl.sum(p, axis=0)
    k = tl.arange(0, K_P2)
    weights = tl.zeros([K_P2], tl.float32)
    ids = tl.zeros([K_P2], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        pick = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
        weights = tl.where(k == j, best, weights)
        ids = tl.where(k == j, pick, ids)
        p = tl.where(e == pick, -1.0, p)
    if RENORM:
        weights = weights / tl.sum(weights, axis=0)
    if HAS_SLOTS:
        ids = tl.where(tl.load(slots_ptr + t) < 0, -1, ids)
    tl.store(w_ptr + t * TOP_K + k, weights, mask=k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + k, ids, mask=k < TOP_K)


def _route_triton(logits, top_k, renormalize, slots):
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            logits, logits if slots is None else slots, weights, ids, experts, logits.stride(0),
            TOP_K=top_k, K_P2=triton.next_power_of_2(top_k),
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
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k]
    -> [T, H] in x's dtype."""
    if use_triton(x):
        return _fused_moe_triton(x, w13, w2, topk_ids, topk_weights)
    return fused_moe_torch(x, w13, w2, topk_ids, topk_weights)


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


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """Pairs sorted by expert, each expert's run padded to whole blocks.

    Returns sorted_ids (int32 [blocks * block_m]: flat pair index t * K + k, or T * K in
    padding) and block_experts (int32 [blocks]: the expert of each block, -1 for blocks past
    the last). `blocks` bounds every routing (each active expert wastes under one block), so
    the shapes depend on T * K alone. Pairs of one expert keep their order."""
    n = topk_ids.numel()
    blocks = triton.cdiv(n, block_m) + min(num_experts, n)
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
def _align_kernel(
    ids_ptr, sorted_ptr, experts_ptr, n, E, num_blocks,
    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr,
    FILL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """align() in one program: counts per expert, each pair's rank among its expert's pairs
    (a running count down the one-hot matrix), its slot, then each block's expert."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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


def _align_triton(topk_ids, num_experts, block_m, blocks):
    n, device = topk_ids.numel(), topk_ids.device
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_experts = torch.empty(blocks, dtype=torch.int32, device=device)
    _align_kernel[(1,)](
        topk_ids.reshape(-1), sorted_ids, block_experts, n, num_experts, blocks,
        BLOCK_N=max(16, triton.next_power_of_2(n)),
        BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
        BLOCK_B=max(16, triton.next_power_of_2(blocks)), BLOCK_M=block_m,
        FILL=blocks * block_m, num_warps=8, **pdl_options(),
    )  # fmt: skip
    return sorted_ids, block_experts


@jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ptr, experts_ptr, weights_ptr,
    N, K, num_pairs, stride_am, stride_we, stride_wn, stride_om,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One block of pairs of one expert x BLOCK_N output columns: out[pair] = a[pair //
    A_ROW_DIV] @ w[e].T over K; GATED: silu(gate) * up of rows n and N + n; WEIGHTED: times
    the pair's routing weight. Blocks of no expert do nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    e = tl.load(experts_ptr + tl.program_id(0))
    if e >= 0:
        pairs = tl.load(sorted_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
        pair_ok = pairs < num_pairs
        a_rows = (pairs // A_ROW_DIV).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w_cols = w_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            a = tl.load(
                a_ptr + a_rows[:, None] * stride_am + kk[None, :],
                mask=pair_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w_ok = k_ok[:, None] & col_ok[None, :]
            w = tl.load(w_cols + kk[:, None], mask=w_ok, other=0.0)
            acc += tl.dot(a, w, input_precision=PRECISION)
            if GATED:
                u = tl.load(w_cols + N * stride_wn + kk[:, None], mask=w_ok, other=0.0)
                up += tl.dot(a, u, input_precision=PRECISION)
        if GATED:
            acc = acc * tl.sigmoid(acc) * up
        if WEIGHTED:
            acc *= tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0)[:, None]
        out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


def _gemm(a, w, out, sorted_ids, block_experts, weights, a_row_div, gated):
    n_out, k = out.shape[1], a.shape[1]
    block_n = min(64, max(16, triton.next_power_of_2(n_out)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_experts.shape[0], triton.cdiv(n_out, block_n))
    _moe_gemm_kernel[grid](
        a, w, out, sorted_ids, block_experts, weights,
        n_out, k, out.shape[0], a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROW_DIV=a_row_div, GATED=gated, WEIGHTED=weights is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", **pdl_options(),
    )  # fmt: skip


def _fused_moe_triton(x, w13, w2, topk_ids, topk_weights):
    tokens, top_k = topk_ids.shape
    pairs = tokens * top_k
    inter, hidden = w2.shape[2], w2.shape[1]
    # unwritten pairs (routed nowhere) must add zero
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    out = torch.zeros(pairs, hidden, dtype=x.dtype, device=x.device)
    if pairs == 0:
        return out.view(tokens, hidden)
    assert x.stride(1) == w13.stride(2) == w2.stride(2) == 1
    sorted_ids, block_experts = align(topk_ids, w13.shape[0])
    weights = topk_weights.reshape(-1).float().contiguous()
    _gemm(x, w13, h, sorted_ids, block_experts, None, top_k, gated=True)
    _gemm(h, w2, out, sorted_ids, block_experts, weights, 1, gated=False)
    return out.view(tokens, top_k, hidden).sum(1)  # float32 accumulation, one kernel
