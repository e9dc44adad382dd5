"""Session 33 probe: host µs per F.linear call (bf16, qwen3-0.6b's prefill shapes) by BLAS backend."""
import time, statistics, torch
import torch.nn.functional as F
shapes = [(512, 1024, 4096), (512, 2048, 1024), (512, 1024, 6144), (512, 3072, 1024), (2048, 1024, 4096), (1, 1024, 151936)]
def host_us(x, w, n=100):
    for _ in range(20): F.linear(x, w)
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n): F.linear(x, w)
        ts.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return round(min(ts), 1)
for lib in ("default", "cublaslt", "cublas"):
    if lib != "default":
        torch.backends.cuda.preferred_blas_library(lib)
    row = {}
    for m, k, n in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        row[f"{m}x{k}x{n}"] = host_us(x, w)
    print(lib, torch.backends.cuda.preferred_blas_library(), row, flush=True)
# device time per call for the same shapes, default library, to see what the host must keep up with
