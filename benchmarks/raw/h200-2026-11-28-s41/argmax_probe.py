"""Session 41's probe: torch's argmax against kernels/argmax.py's split argmax on logits rows,
µs a call from 20 calls captured in a CUDA graph (no launch overhead), and the full names of
the kernels torch's argmax launches (the step profile cuts them at 60 characters)."""

import torch
from torch.profiler import ProfilerActivity, profile

from ostinato.kernels.argmax import argmax_rows


def per_call_us(fn, calls=20, replays=20):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * replays)


print("| vocab | dtype | rows | torch µs | ours µs | equal |")
print("|---|---|---|---|---|---|")
for vocab in (128256, 151936):
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 8, 32, 256):
            x = (torch.randn(rows, vocab, device="cuda") * 4).to(dtype)
            same = torch.equal(x.argmax(dim=-1), argmax_rows(x))
            t = per_call_us(lambda x=x: x.argmax(dim=-1))
            o = per_call_us(lambda x=x: argmax_rows(x))
            print(f"| {vocab} | {str(dtype)[6:]} | {rows} | {t:.1f} | {o:.1f} | {same} |")
for vocab in (128256, 151936):
    x = torch.randn(1, vocab, device="cuda", dtype=torch.bfloat16)
    x.argmax(dim=-1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            x.argmax(dim=-1)
        torch.cuda.synchronize()
    for event in prof.key_averages():
        if event.device_type.name == "CUDA":
            print(vocab, f"{event.device_time_total / event.count:.1f} µs", event.key)
