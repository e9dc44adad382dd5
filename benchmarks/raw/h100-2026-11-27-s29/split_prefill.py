"""Session 29: does splitting the KV of a short fresh prefill (whose latest query tile's serial
loop over every key is the launch's critical path) pay, combine included? Default launch with
DIRECT (the engine's), the same from the cache, and with 2, 4, 8 parts (cache; a split launch
reads no k/v directly), at qwen3-0.6b's and Llama-3.1-8B's heads. µs per call in CUDA graphs."""
import sys

sys.path.insert(0, "benchmarks")
import bench_kernels as bk

for heads in (16, 32):
    bk.HEADS, bk.KV_HEADS = heads, 8
    pool = bk.KVPool(blocks=128 * 8192 // bk.BLOCK)
    cases = [[512], [1024], [256, 256], [512, 512], [2048], [512] * 8]
    for q_lens in cases:
        default = bk._config_for(q_lens, q_lens, pool)
        row = [("direct", bk.graph_seconds(pool.calls(q_lens, q_lens, default, new_kv=True))),
               ("cache", bk.graph_seconds(pool.calls(q_lens, q_lens, default)))]
        for splits in (2, 4, 8):
            row.append((f"split{splits}", bk.graph_seconds(pool.calls(q_lens, q_lens, default._replace(splits=splits)))))
        for bm in (32,):
            cfg = default._replace(block_m=bm, block_q=max(1, bm // (heads // 8)))
            row.append((f"bm{bm}", bk.graph_seconds(pool.calls(q_lens, q_lens, cfg, new_kv=True))))
            row.append((f"bm{bm}s2", bk.graph_seconds(pool.calls(q_lens, q_lens, cfg._replace(splits=2)))))
        case = f"{heads}h {q_lens[0]}x{len(q_lens)} {tuple(default)}"
        print(f"{case:44s} " + "  ".join(f"{n} {s * 1e6:6.1f}" for n, s in row), flush=True)
