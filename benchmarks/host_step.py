"""Host time of one eager decode step's GPU path, measured on a CPU: the Python the model runs
between its Triton launches, with every launch stubbed where the compiled launcher would be
called.

    PYTHONPATH=. python3 benchmarks/host_step.py [--steps 400] [--profile 40]

The model is qwen3-0.6b's architecture (28 layers, 16 query and 8 KV heads of 128, q/k norms,
tied embeddings) with narrow widths (hidden 64, MLP 192, vocab 512): every projection still
takes the small-batch kernel at batch 1 (gemv.rows_pay) and the LM head still takes F.linear,
as at full width on the GPU, and the CPU's arithmetic is negligible. A ModelRunner on the CPU
with the Triton attention backend runs `--batch` one-token requests: the forward context (the
attention plan), the model and the LM head, as `ModelRunner.launch` does in mode `none`.

To take the GPU's branches on the CPU, tensors answer `is_cuda` as True (so `use_triton`,
`gemv_pays` and the attention backend decide as on a GPU, each paying its own checks),
TRITON_INTERPRET is unset (so `interpreting()` reads the environment and answers False, and
Launch goes direct), the SM count is an H100's 132 and PDL is on. A kernel's first launch
returns a stand-in for the compiled kernel whose launcher does nothing.

Not covered: Triton's launcher (its C launch and the driver call, about 4 µs a launch on the
H100 host; with Triton 3.6, kernels/launch.py skips CudaLauncher.__call__'s Python, which
other versions still run), torch's CUDA allocator and kernel launches (embedding, LM head,
index: a few µs each on the GPU, CPU ops here), the step's input copies and the sampler (as
in graph modes). The CPU is not the GPU host's: compare runs made on one machine, at one time.
Prints µs of CPU time per step (the least of --repeats runs of --steps steps) and a cProfile
top list.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

import torch

from ostinato.config import EngineConfig
from ostinato.graphs.modes import BatchDescriptor
from ostinato.kernels import dispatch, gemv, launch, paged_attention
from ostinato.loader import load_hf_config
from ostinato.runner.model_runner import ModelRunner

NARROW = {"hidden_size": 64, "intermediate_size": 192, "vocab_size": 512}
H100_SMS = 132


class _Compiled:
    """What Launch keeps of a compiled kernel: its launcher (here a no-op)."""

    function = packed_metadata = None

    @staticmethod
    def run(*args) -> None:
        pass


def _stub_run(self, *args, grid, warmup, **kwargs):
    return _Compiled


def take_gpu_branches() -> None:
    """Make the CPU process take the GPU's code paths, launching nothing (module docstring)."""
    os.environ.pop("TRITON_INTERPRET", None)
    # a C getter, as is_cuda's own, so the checks cost what they cost on the GPU
    torch.Tensor.is_cuda = property(torch._C.TensorBase.is_cpu.__get__)
    torch.cuda.is_current_stream_capturing = lambda: False
    launch._current_stream = lambda device: 0
    dispatch.Kernel.run = _stub_run
    dispatch._has_pdl = lambda: True
    for module in (gemv, paged_attention):
        module.num_sms = lambda device, interpreted: H100_SMS


def make_runner(batch: int) -> ModelRunner:
    config = EngineConfig(
        model="random:qwen3-0.6b", device="cpu", dtype="bfloat16", attention_backend="triton",
        cuda_graph_mode="none", max_model_len=1024, max_num_seqs=max(batch, 8),
        max_num_batched_tokens=1024,
    )  # fmt: skip
    hf_config = load_hf_config(config.model)
    for name, value in NARROW.items():
        setattr(hf_config, name, value)
    runner = ModelRunner(config, hf_config)
    runner.start()
    runner.buffers.load(runner._dummy(batch, batch))
    return runner


def step(runner: ModelRunner, batch: int) -> torch.Tensor:
    """The eager step's forward and LM head (ModelRunner.launch in mode none, under the
    descriptor its dispatch gives a decode batch)."""
    out = runner._forward_desc(BatchDescriptor(batch, batch, 1, 0))
    return runner._logits(out, 0, batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", type=int, default=30, help="top functions (0: none)")
    args = parser.parse_args()
    take_gpu_branches()
    torch.set_num_threads(1)
    runner = make_runner(args.batch)
    with torch.inference_mode():
        for _ in range(5):  # first launches build the Launch objects and their keys
            step(runner, args.batch)
        times = []
        for _ in range(args.repeats):
            t0 = time.process_time()  # CPU time: other processes on the machine add none
            for _ in range(args.steps):
                step(runner, args.batch)
            times.append((time.process_time() - t0) / args.steps * 1e6)
        print(f"eager decode step, batch {args.batch}: {min(times):.0f} µs of CPU time "
              f"(runs: {', '.join(f'{t:.0f}' for t in times)})")  # fmt: skip
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.steps):
                step(runner, args.batch)
            profiler.disable()
            print(f"cProfile over {args.steps} steps (times are totals):")
            stats = pstats.Stats(profiler).sort_stats("tottime")
            stats.print_stats(args.profile)


if __name__ == "__main__":
    main()
