"""Decode attention at short contexts with the engine's block-table width (2048 tokens): the
split rule as it is (ONE_PART_KV 0) against one part up to 128/256/384 positions. Run from a
tree whose paged_attention has ONE_PART_KV."""
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_kernels import graph_seconds  # noqa: E402

from ostinato.kernels import paged_attention as attention  # noqa: E402

BLOCK, HEAD_DIM, WIDTH = 16, 128, 128
SHAPES = (("qwen3-30b-a3b", 32, 4), ("qwen3-0.6b", 16, 8))
torch.manual_seed(0)
for name, heads, kv_heads in SHAPES:
    blocks = 16384
    k = torch.randn(blocks, BLOCK, kv_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for batch in (1,):
        for context in (128, 192, 256, 384, 576):
            row = []
            for one_part in (0, 128, 256, 384):
                attention.ONE_PART_KV = one_part
                calls = []
                for i in range(32):
                    order = torch.randperm(blocks, device="cuda", dtype=torch.int32)
                    table = order[: batch * WIDTH].view(batch, WIDTH).contiguous()
                    q = torch.randn(batch, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                    out = torch.empty_like(q)
                    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
                    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
                    launch = attention.PagedAttention(q, out, k, qsl, lens, table, HEAD_DIM**-0.5)
                    calls.append(lambda launch=launch, q=q, out=out: launch(q, k, v, out))
                row.append(graph_seconds(calls) * 1e6)
            print(f"{name} b{batch} ctx {context}: " + "  ".join(
                f"one_part<={o}: {us:.2f}" for o, us in zip((0, 128, 256, 384), row)), flush=True)
    del k, v
