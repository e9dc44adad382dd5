"""Session 25: prefill attention launch configurations at qwen3-0.6b's shape (16 heads, 8 KV
heads, head_dim 128, GQA group 2), where the default (from the Llama-3.1-8B sweep, group 4)
runs a 512-token prompt at 61 TFLOP/s. bench_kernels' pool and timing (CUDA graphs, L2
flushed by disjoint blocks), fastest first, with the fraction of the matmul rate."""
import sys
sys.path.insert(0, "benchmarks")
import bench_kernels as bk

bk.HEADS, bk.KV_HEADS = 16, 8
C = bk.attention.Config
variants = [
    C(32, 64, 64, 1, 4, 2), C(32, 64, 64, 1, 4, 3), C(32, 64, 32, 1, 4, 2), C(32, 64, 128, 1, 4, 2),
    C(32, 64, 64, 1, 8, 2), C(16, 32, 64, 1, 4, 2), C(16, 32, 32, 1, 4, 2), C(16, 32, 64, 1, 2, 2),
    C(16, 32, 64, 1, 4, 3), C(16, 32, 128, 1, 4, 2), C(64, 128, 64, 1, 8, 2), C(64, 128, 64, 1, 4, 2),
    C(64, 128, 32, 1, 4, 3), C(64, 128, 64, 1, 8, 3), C(8, 16, 64, 1, 2, 2), C(8, 16, 32, 1, 2, 2),
]
pool = bk.KVPool(blocks=128 * 8192 // bk.BLOCK)
for batch, length in ((1, 512), (1, 1024), (1, 2048), (16, 512), (4, 512)):
    q_lens = [length] * batch
    flops = bk.prefill_flops(q_lens)
    rows = bk._time_variants(pool, f"prefill {batch} x {length}", q_lens, q_lens, variants)
    for case, config, us in rows[:6]:
        rate = flops / (float(us) / 1e6) / 1e12
        print(f"{case:18s} {us:>8s} us {rate:6.0f} TFLOP/s  {config}")
    default = [r for r in rows if "(default)" in r[1]]
    print(f"{'':18s} default: {default[0][2] if default else '?'} us, rank {rows.index(default[0]) + 1 if default else '?'} of {len(rows)}")
    sys.stdout.flush()
