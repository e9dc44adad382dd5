"""InputBuffers.load on the GPU host: µs per call for a 512-token prompt and a batch-32 decode
step, with the engine's buffer sizes (8192 tokens, 256 requests, 2048 / 16 blocks). Run from a
tree (s0: seven copies; p1: one copy and the unpack kernel)."""
import time

import torch

from ostinato.engine.scheduler import ScheduledBatch
from ostinato.engine.sequence import Sequence
from ostinato.graphs.modes import BatchDescriptor, CudaGraphMode
from ostinato.runner.input_buffers import InputBuffers
from ostinato.runner.step import build_step
from ostinato.sampling_params import SamplingParams


def seq(i, tokens, computed, blocks):
    s = Sequence(f"r{i}", tokens, SamplingParams())
    s.num_computed_tokens, s.block_ids = computed, blocks
    return s


def step(kind):
    if kind == "prefill512":
        seqs, lens = [seq(0, list(range(512)), 0, list(range(32)))], [512]
        desc = BatchDescriptor(512, 1, None, 0)
    else:
        seqs = [seq(i, list(range(600)), 599, list(range(40 * i, 40 * i + 38))) for i in range(32)]
        lens, desc = [1] * 32, BatchDescriptor(32, 32, 1, 0)
    return build_step(ScheduledBatch(seqs, lens), 16, lambda *_: (CudaGraphMode.FULL, desc))


b = InputBuffers(8192, 256, 128, torch.device("cuda"))
for kind in ("prefill512", "decode32"):
    s = step(kind)
    for _ in range(50):
        b.load(s)
    torch.cuda.synchronize()
    for sync in (False, True):
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            b.load(s)
            if sync:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        print(f"{kind} sync={sync}: {(time.perf_counter() - t0) / n * 1e6:.1f} µs per load", flush=True)
