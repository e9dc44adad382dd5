"""Session 28: prefill attention reading the new tokens' KV from the step's k and v (DIRECT)
against the cache-only launch, fresh prompts, at qwen3-0.6b's shape (16 heads, 8 KV heads) and
Llama-3.1-8B's (32 / 8), head_dim 128: bench_kernels' pool and timing (CUDA graphs, L2 flushed
by disjoint shuffled blocks). µs per call, TFLOP/s; the default launch and a few others."""
import sys

sys.path.insert(0, "benchmarks")
import bench_kernels as bk

C = bk.attention.Config
for heads in (16, 32):
    bk.HEADS, bk.KV_HEADS = heads, 8
    group = heads // 8
    pool = bk.KVPool(blocks=128 * 8192 // bk.BLOCK)
    others = [C(64 // group, 64, 64, 1, 4, 3), C(64 // group, 64, 128, 1, 4, 2),
              C(128 // group, 128, 64, 1, 8, 2), C(128 // group, 128, 64, 1, 8, 3),
              C(128 // group, 128, 128, 1, 8, 2), C(32 // group, 32, 64, 1, 4, 2)]
    for batch, length in ((1, 512), (1, 1024), (1, 2048), (8, 512), (1, 4096)):
        q_lens = [length] * batch
        flops = bk.prefill_flops(q_lens)
        default = bk._config_for(q_lens, q_lens, pool)
        for config in [default] + others:
            try:
                us = [bk.graph_seconds(pool.calls(q_lens, q_lens, config, new_kv=nk)) * 1e6
                      for nk in (False, True)]
            except Exception as error:
                print(f"{heads}h {batch}x{length} {config}: {type(error).__name__}")
                continue
            tag = "default" if config == default else bk._short(config)
            print(f"{heads}h {batch:2d} x {length:5d}  cache {us[0]:8.1f} us {flops / us[0] / 1e6:5.0f} TF"
                  f"  direct {us[1]:8.1f} us {flops / us[1] / 1e6:5.0f} TF  ({us[0] / us[1]:.2f}x)  {tag}")
            sys.stdout.flush()
