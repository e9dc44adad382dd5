"""Session 25: decode attention at the batch sizes of offline throughput (qwen3-0.6b's shape:
16 heads, 8 KV heads, head_dim 128), where the KV cache's bytes set a decode step's time:
the default launch and variants around it, fastest first, with the KV read rate (bench_kernels'
pool and timing: CUDA graphs, L2 flushed by disjoint blocks)."""
import sys
sys.path.insert(0, "benchmarks")
import bench_kernels as bk

bk.HEADS, bk.KV_HEADS = 16, 8
pool = bk.KVPool(blocks=128 * 8192 // bk.BLOCK)
for batch in (64, 128, 256):
    for context in (576, 1088):
        q_lens, seq_lens = [1] * batch, [context] * batch
        base = bk._config_for(q_lens, seq_lens, pool)
        variants = [base] + [base._replace(**c) for c in (
            dict(splits=max(1, base.splits // 2)), dict(splits=base.splits * 2),
            dict(block_n=16), dict(block_n=64), dict(block_n=128), dict(num_stages=3),
            dict(num_stages=4), dict(num_warps=2), dict(num_warps=8),
            dict(block_n=64, num_stages=3), dict(block_n=64, num_warps=8),
        )]
        rows = bk._time_variants(pool, f"decode {batch} x {context}", q_lens, seq_lens, variants)
        kv_bytes = batch * context * bk.KV_HEADS * bk.HEAD_DIM * 2 * 2
        for case, config, us in rows[:5]:
            print(f"{case:18s} {us:>8s} us {kv_bytes / (float(us) * 1e-6) / 1e12:5.2f} TB/s  {config}")
        default = [r for r in rows if "(default)" in r[1]][0]
        print(f"{'':18s} default {default[2]} us ({kv_bytes / (float(default[2]) * 1e-6) / 1e12:.2f} TB/s), rank {rows.index(default) + 1} of {len(rows)}")
        sys.stdout.flush()
