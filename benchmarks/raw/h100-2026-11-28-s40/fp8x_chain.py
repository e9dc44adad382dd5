"""Session 40 probe (issue 21, FP8 batch 32): llama-3.1-8b's FP8 step weights as a chain of
projections at 16 / 32 rows, our kernel (x quantised per group inside its loop) against a probe
kernel whose x comes already quantised to FP8 (a scale a token, or a scale a group of 128),
FP8 x FP8 on the tensor cores with the weight rows on the M side, the splits' sum left out as
chain_floor's probes leave it. `+quant`: the existing per-token quantize kernel before each
projection (what a separate quantize launch would cost).

    cd benchmarks && PYTHONPATH=..:. python3 raw/h100-2026-11-28-s40/fp8x_chain.py
"""

import sys

import torch
import triton
import triton.language as tl
from bench_kernels import graph_seconds
from chain_floor import layer_weights, step_reads, views

from ostinato.bench import copy_bandwidth
from ostinato.kernels import fp8
from ostinato.loader import load_hf_config


@triton.jit
def _fp8x_kernel(x_ptr, xs_ptr, w_ptr, out_ptr, y_ptr, sem_ptr, M, N, K, span, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPED: tl.constexpr,
                 SUM: tl.constexpr, UNROLL: tl.constexpr):
    tile, split = tl.program_id(0), tl.program_id(1)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, ROWS)
    k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    x_rows = x_ptr + r[:, None] * K
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, ROWS], tl.float32)
    k_lo = split * span
    for k0 in range(k_lo, k_lo + span, BLOCK_K):
        w = tl.load(w_rows + (k0 + k)[None, :])
        x = tl.load(x_rows + (k0 + k)[None, :], mask=(r < M)[:, None], other=0.0)
        if GROUPED:
            xs = tl.load(xs_ptr + r * (K // 128) + k0 // 128, mask=r < M, other=0.0)
            acc += tl.dot(w, tl.trans(x)) * xs[None, :]
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    if not GROUPED:
        acc *= tl.load(xs_ptr + r, mask=r < M, other=0.0)[None, :]
    parts = out_ptr + r[None, :] * N + n[:, None]
    tl.store(parts + split * M * N, acc, mask=(r < M)[None, :])
    if SUM:  # as ostinato's small-batch kernels sum a split: the last program of a tile
        tl.debug_barrier()
        count = tl.atomic_add(sem_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if count == tl.num_programs(1) - 1:
            total = tl.zeros([BLOCK_N, ROWS], tl.float32)
            if UNROLL:  # every part's load in flight at once, as small_batch.gather
                for p in tl.static_range(UNROLL):
                    total += tl.load(parts + p * M * N, mask=(r < M)[None, :], other=0.0,
                                     cache_modifier=".cg")
            else:
                for p in range(0, tl.num_programs(1)):
                    total += tl.load(parts + p * M * N, mask=(r < M)[None, :], other=0.0,
                                     cache_modifier=".cg")
            tl.store(y_ptr + r[None, :] * N + n[:, None], total.to(tl.bfloat16),
                     mask=(r < M)[None, :])
            tl.store(sem_ptr + tile, 0)


_counts = {}


def probe(block_n=128, block_k=128, stages=4, warps=4, grouped=False, per_sm=2, quant=False,
          summed=False, unroll=False):
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def project(x, xq, xs, w):
        if quant:
            xq, xs = fp8.quantize_tokens(x)
        (m, k), n = xq.shape, w.shape[0]
        tiles, chunks = n // block_n, k // block_k
        split = 1
        while tiles * split * 2 <= per_sm * sms and chunks % (split * 2) == 0 and chunks // split >= 8:
            split *= 2
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
        if tiles not in _counts:
            _counts[tiles] = torch.zeros(tiles, dtype=torch.int32, device=x.device)
        _fp8x_kernel[(tiles, split)](xq, xs, w, out, y, _counts[tiles], m, n, k, k // split,
                                     ROWS=max(16, m), BLOCK_N=block_n, BLOCK_K=block_k,
                                     GROUPED=grouped, SUM=summed and split > 1,
                                     UNROLL=split if unroll else 0,
                                     num_warps=warps, num_stages=stages, launch_pdl=True)
        return y

    return project


def ours(x, xq, xs, w, scale):
    return fp8.fp8_linear(x, w, scale)


def ours_quantized(warps=None, block_k=None, split=None):
    """fp8_gemv on x quantised per group beforehand (the norm kernel's hand-over), in
    gemv_config's launch or with its warps / chunk / split changed."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def project(q, s, w, scale):
        (m, k), n = q.shape, w.shape[0]
        config = fp8.gemv_config(m, n, k, None, sms)
        if warps:
            config = config._replace(num_warps=warps)
        if block_k or split:
            bk = block_k or config.block_k
            parts = split(n, k, config) if split else config.split
            span = triton.cdiv(triton.cdiv(k, parts), bk) * bk
            config = config._replace(block_k=bk, span=span, split=triton.cdiv(k, span))
        return fp8.fp8_gemv(q, w, scale, None, config, x_scales=s, dtype=torch.bfloat16)

    return project


def probe_split(n, k, config):
    """The probe's split: doubled while two programs an SM have room and 8 chunks a part."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles, chunks, split = n // 128, k // 128, 1
    while tiles * split * 2 <= 2 * sms and chunks % (split * 2) == 0 and chunks // split >= 8:
        split *= 2
    return split


def main():
    c = load_hf_config("random:llama-3.1-8b")
    bandwidth = copy_bandwidth()
    print(f"copy {bandwidth / 1e12:.2f} TB/s")
    print("| rows | chain | ms a step | weights floor ms | x floor |")
    print("|---|---|---|---|---|")
    for rows in map(int, (sys.argv[1] if len(sys.argv) > 1 else "32,16").split(",")):
        sizes, head_bytes = step_reads(c, 1, rows)
        total = c.num_hidden_layers * sum(sizes)
        buffer = torch.randint(-(2**31), 2**31 - 1, (total // 4 + 1,), dtype=torch.int32, device="cuda")
        matrices = [(n, k) for _, n, k, _ in layer_weights(c, rows)] * c.num_hidden_layers
        weights = views(buffer, matrices, 1)
        floor = total / bandwidth * 1e3
        inputs = []
        for w in weights:
            x = torch.randn(rows, w.shape[1], device="cuda", dtype=torch.bfloat16)
            xq, xs = fp8.quantize_tokens(x)
            xg = torch.rand(rows, w.shape[1] // 128, device="cuda")
            qg, sg = fp8.quantize_groups(x, 128)
            inputs.append((x, xq, xs, xg, w, torch.ones(w.shape[0], 1, device="cuda"), qg, sg))
        variants = {"ours (fp8_linear)": None}
        for name, fn in {
            "ours, x quantised before": ours_quantized(),
        }.items():
            variants[name] = fn
        for bn, bk, st, wp, g, ps, q, sm, un in [
            (128, 128, 4, 4, True, 2, False, False, False),
            (128, 128, 4, 4, True, 2, False, True, False),
            (128, 128, 4, 4, True, 2, False, True, True),
            (128, 128, 4, 4, False, 2, False, True, True),
        ]:
            name = f"fp8x {bn}x{bk} s{st} w{wp} " + (f"{ps}/SM" if ps else "no split") + (
                " unrolled" if un else "") + (" grouped" if g else "") + (
                " +quant" if q else "") + (" +sum" if sm else "")
            variants[name] = probe(bn, bk, st, wp, g, ps, q, sm, un)
        for name, fn in variants.items():
            if fn is None:
                step = lambda: [ours(x, xq, xs, w, s) for x, xq, xs, xg, w, s, qg, sg in inputs]  # noqa: E731
            elif name.startswith("ours"):
                step = lambda fn=fn: [fn(qg, sg, w, s) for x, xq, xs, xg, w, s, qg, sg in inputs]  # noqa: E731
            elif "grouped" in name:
                step = lambda fn=fn: [fn(x, xq, xg, w) for x, xq, xs, xg, w, s, qg, sg in inputs]  # noqa: E731
            else:
                step = lambda fn=fn: [fn(x, xq, xs, w) for x, xq, xs, xg, w, s, qg, sg in inputs]  # noqa: E731
            try:
                ms = graph_seconds([step], replays=20) * 1e3
            except Exception as e:
                print(f"| {rows} | {name} | failed: {type(e).__name__}: {str(e)[:200]} | | |")
                continue
            print(f"| {rows} | {name} | {ms:.3f} | {floor:.3f} | {ms / floor:.3f} |", flush=True)
        del inputs, weights, buffer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
