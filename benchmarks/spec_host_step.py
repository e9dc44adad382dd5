"""Host time per decode step that speculation can add, without a model: the scheduler (with
the n-gram proposer) and build_step, for B requests decoding from prompts of distinct tokens.

    PYTHONPATH=. python3 benchmarks/spec_host_step.py --batch-sizes 1,8

Workloads: norepeat (each step appends a token never seen before, from a 151936-token
vocabulary: nothing is drafted, so speculation should cost nothing), repeat (each step appends
the prompt's next token: every request has a draft every step). Prints the median microseconds
per step of schedule(), build_step() and complete() plus the engine's token append, with and
without speculation (k = 4). Single-threaded; on a loaded machine, compare runs made together.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from ostinato.config import EngineConfig
from ostinato.engine.block_manager import BlockManager
from ostinato.engine.scheduler import Scheduler
from ostinato.engine.sequence import Sequence
from ostinato.graphs.modes import BatchDescriptor, CudaGraphMode
from ostinato.runner.step import build_step
from ostinato.sampling_params import SamplingParams

PROMPT_VOCAB = 30000  # prompts are distinct tokens below it, as bench's norepeat workload


def full_graph(num_tokens: int, num_reqs: int, q: int | None, num_loras: int):
    return CudaGraphMode.FULL, BatchDescriptor(num_tokens, num_reqs, q, num_loras)


def decode_steps(args, batch: int, spec: bool, seed: int) -> list[tuple[int, int, int]]:
    """Nanoseconds of (schedule, build_step, complete + append) for each decode step."""
    kw = {"speculative_method": "ngram", "num_speculative_tokens": 4} if spec else {}
    config = EngineConfig(device="cpu", max_model_len=args.input_len + args.output_len + 4, **kw)
    scheduler = Scheduler(config, BlockManager(8192, config.block_size))
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    seqs = [
        Sequence(f"r{i}", rng.permutation(PROMPT_VOCAB)[: args.input_len].tolist(), params)
        for i in range(batch)
    ]
    for seq in seqs:
        scheduler.add(seq)

    def next_tokens(seq: Sequence, batch) -> list[int]:
        if args.workload == "repeat":  # the prompt again: every draft is right
            n = len(seq) - args.input_len
            return seq.token_ids[n : n + 1 + len(batch.drafts[batch.seqs.index(seq)])]
        return [int(rng.integers(PROMPT_VOCAB, args.vocab))]  # never seen before

    times = []
    while len(seqs[0]) < args.input_len + args.output_len:
        t0 = time.perf_counter_ns()
        batch = scheduler.schedule()
        t1 = time.perf_counter_ns()
        build_step(batch, config.block_size, full_graph)
        t2 = time.perf_counter_ns()
        new = {seq: next_tokens(seq, batch) for seq in batch.seqs}
        t3 = time.perf_counter_ns()
        for seq, tokens in new.items():
            seq.token_ids += tokens
        scheduler.complete(batch, {seq.request_id: len(new[seq]) - 1 for seq in batch.seqs})
        t4 = time.perf_counter_ns()
        times.append((t1 - t0, t2 - t1, t4 - t3))
    return times[1:]  # the first is the prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--workload", choices=["norepeat", "repeat"], default="norepeat")
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for batch in map(int, args.batch_sizes.split(",")):
        for spec in (False, True):
            steps = [t for seed in range(args.runs) for t in decode_steps(args, batch, spec, seed)]
            us = [statistics.median(part) / 1e3 for part in zip(*steps, strict=True)]
            print(
                f"{args.workload} batch {batch} {'spec k=4' if spec else 'plain   '}: "
                f"schedule {us[0]:6.1f} us, build_step {us[1]:6.1f} us, "
                f"complete {us[2]:5.1f} us, total {sum(us):6.1f} us"
            )


if __name__ == "__main__":
    main()
