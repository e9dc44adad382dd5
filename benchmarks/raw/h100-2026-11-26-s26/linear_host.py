"""Session 26: host time of one F.linear (bf16) eagerly and under CUDA graph capture, by BLAS
library preference and row count: is cuBLAS what makes capture cost ~10 ms a graph?"""
import time
import torch
import torch.nn.functional as F

w = torch.randn(3072, 1024, dtype=torch.bfloat16, device="cuda")
print("default blas library:", torch.backends.cuda.preferred_blas_library())
for lib in ("cublas", "cublaslt"):
    torch.backends.cuda.preferred_blas_library(lib)
    for m in (64, 512, 2048):
        x = torch.randn(m, 1024, dtype=torch.bfloat16, device="cuda")
        for _ in range(20):
            F.linear(x, w)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            F.linear(x, w)
        eager = (time.perf_counter() - t) / 200 * 1e6
        torch.cuda.synchronize()
        g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            g.capture_begin()
            t = time.perf_counter()
            for _ in range(200):
                F.linear(x, w)
            captured = (time.perf_counter() - t) / 200 * 1e6
            t = time.perf_counter()
            g.capture_end()
            end = (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
        print(f"{lib:9s} rows {m:5d}: eager {eager:6.1f} us, under capture {captured:6.1f} us a call; capture_end of 200 {end:.2f} ms")

from ostinato.kernels.norm import rms_norm  # a Triton launch through ostinato's cached launcher

nw = torch.ones(1024, dtype=torch.bfloat16, device="cuda")
for m in (64, 512):
    x = torch.randn(m, 1024, dtype=torch.bfloat16, device="cuda")
    for _ in range(20):
        rms_norm(x, nw, 1e-6)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(200):
        rms_norm(x, nw, 1e-6)
    eager = (time.perf_counter() - t) / 200 * 1e6
    torch.cuda.synchronize()
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.capture_begin()
        t = time.perf_counter()
        for _ in range(200):
            rms_norm(x, nw, 1e-6)
        captured = (time.perf_counter() - t) / 200 * 1e6
        g.capture_end()
    torch.cuda.synchronize()
    print(f"rms_norm  rows {m:5d}: eager {eager:6.1f} us, under capture {captured:6.1f} us a call")
