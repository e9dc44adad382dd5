"""llama-3.1-8b's MLP at one row: the one-row kernel (its fusions) in its default launch and a
few others, against the unfused path (norm kernel + cuBLAS + SiLU kernel; cuBLAS alone for down),
each call on its own weights from a ring larger than L2. Run from a tree's root."""
import sys

import torch
import triton

sys.path.insert(0, "benchmarks")
from bench_kernels import L2_FLUSH_BYTES, _ProjectionCase, copy_bandwidth, graph_seconds  # noqa: E402

from ostinato.kernels import gemv as g  # noqa: E402

bw = copy_bandwidth()
print(f"copy bandwidth {bw / 1e12:.3f} TB/s")
for name, (n, k, silu, normed) in {
    "gate|up (norm + SiLU)": (28672, 4096, True, True),
    "down (add)": (4096, 14336, False, False),
    "qkv (norm)": (6144, 4096, False, True),
    "o (add)": (4096, 4096, False, False),
}.items():
    count = max(4, min(64, L2_FLUSH_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
    case = _ProjectionCase(1, n, k, silu, normed, weights, torch.randn(k, device="cuda", dtype=torch.bfloat16))
    n_out = n // 2 if silu else n
    default = g.gemv_config(1, n_out, k, 2, 132)
    configs = [default] + [
        g.GemvConfig(1, bn, bk, triton.cdiv(k, bk) * bk, 1, w, 1)
        for bn in (2, 4, 8) for bk in (1024, 2048) for w in (4, 8) if bn * bk <= 16384
    ]
    times = {}
    for c in dict.fromkeys(configs):
        try:
            times[c] = graph_seconds(case.ours(c))
        except Exception as e:  # noqa: BLE001
            print("  failed", c, repr(e)[:120])
    unfused = graph_seconds(case.unfused())
    cublas = graph_seconds(case.cublas())
    floor = n * k * 2 / bw
    best = min(times, key=times.get)
    print(f"{name}: floor {floor * 1e6:.1f} us; ours default {times[default] * 1e6:.1f} "
          f"(bn {default.block_n} bk {default.block_k} w {default.num_warps}); best {times[best] * 1e6:.1f} "
          f"(bn {best.block_n} bk {best.block_k} w {best.num_warps}); unfused {unfused * 1e6:.1f}; cuBLAS {cublas * 1e6:.1f}")
    print("   ", " ".join(f"{c.block_n}x{c.block_k}/{c.num_warps}w:{t * 1e6:.1f}" for c, t in sorted(times.items(), key=lambda x: x[1])))
