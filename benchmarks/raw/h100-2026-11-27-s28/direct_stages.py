"""Session 28, second sweep: the DIRECT loop's pipeline depth (DIRECT_STAGES) with the default
launch, against the cache-only launch, at qwen3-0.6b's and Llama-3.1-8B's heads; fresh prompts
and a chunk after cached context (q 1,024 of 4,096; q 512 of 2,560), where the cache's tiles
dominate. µs per call in CUDA graphs (bench_kernels' pool: shuffled blocks, L2 flushed)."""
import sys

sys.path.insert(0, "benchmarks")
import bench_kernels as bk

C = bk.attention.Config
for heads in (16, 32):
    bk.HEADS, bk.KV_HEADS = heads, 8
    group = heads // 8
    pool = bk.KVPool(blocks=128 * 8192 // bk.BLOCK)
    wide = C(128 // group, 128, 64, 1, 8, 2)
    cases = [([512], [512]), ([1024], [1024]), ([2048], [2048]), ([512] * 8, [512] * 8),
             ([4096], [4096]), ([1024], [4096]), ([512], [2560])]
    for q_lens, seq_lens in cases:
        flops = bk.prefill_flops(q_lens)  # fresh prompts' count; chunks: only for the ratio
        default = bk._config_for(q_lens, seq_lens, pool)
        row = []
        bk.attention.DIRECT_STAGES = 2
        row.append(("cache", bk.graph_seconds(pool.calls(q_lens, seq_lens, default))))
        for stages in (2, 3, 4):
            bk.attention.DIRECT_STAGES = stages
            row.append((f"direct{stages}", bk.graph_seconds(pool.calls(q_lens, seq_lens, default, new_kv=True))))
        bk.attention.DIRECT_STAGES = 3
        row.append(("wide-direct3", bk.graph_seconds(pool.calls(q_lens, seq_lens, wide, new_kv=True))))
        case = f"{heads}h q {q_lens[0]}x{len(q_lens)} of {seq_lens[0]}"
        print(f"{case:24s} " + "  ".join(f"{name} {s * 1e6:7.1f}" for name, s in row), flush=True)
