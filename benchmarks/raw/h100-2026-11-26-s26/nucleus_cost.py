"""Session 26: the nucleus kernel (kernels/nucleus.py) against the sort, ms per call (CUDA events,
20 calls after 3), by rows and by SPLITS (points per pass; PASSES follows)."""
import torch
from ostinato.kernels import nucleus

def passes(splits):
    n, length = 0, nucleus.ONE_BITS + 1
    while length > 1:
        length, n = -(-length // (splits + 1)), n + 1
    return n

def timed(fn):
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); a.record()
    for _ in range(20):
        fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / 20

for rows in (1, 16, 32, 64, 128, 256):
    logits = torch.randn(rows, 151936, device="cuda") * 3
    top_p = torch.full((rows,), 0.9, device="cuda")
    line = [f"rows {rows:3d}: sort {timed(lambda: nucleus.top_p_mask_torch(logits, top_p)):6.3f}"]
    for splits in (4, 8, 16, 32):
        nucleus.SPLITS, nucleus.PASSES = splits, passes(splits)
        nucleus._launches.clear()
        line.append(f"splits {splits} x {nucleus.PASSES} passes {timed(lambda: nucleus.top_p_mask(logits, top_p)):6.3f}")
    print("; ".join(line), flush=True)
