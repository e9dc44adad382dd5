"""Mutation score of one core module, with mutmut: the module alone is mutated and only its own
tests run against each mutant, so one module fits a developer's session.

    nice -n 10 python benchmarks/mutation.py sampler      # one module
    python benchmarks/mutation.py --list                   # the modules and their tests

It prints the score (killed + timeouts over all mutants) and the survivors; `mutmut show NAME`
prints a survivor's diff. Scores are recorded in benchmarks/mutation.md.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import shutil
import sys
from pathlib import Path

# One thread per test process: mutmut's timeouts are CPU seconds, which torch's thread pool
# would multiply (and a shared machine has few cores anyway).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# module -> (source file, the tests that guard it)
MODULES: dict[str, tuple[str, list[str]]] = {
    "sampler": (
        "ostinato/runner/sampler.py",
        ["tests/test_sampler.py", "tests/test_rejection.py", "tests/test_sampling_params.py"],
    ),
    "rejection": ("ostinato/speculative/rejection.py", ["tests/test_rejection.py"]),
    "ngram": ("ostinato/speculative/ngram.py", ["tests/test_ngram.py"]),
    "protocol": ("ostinato/server/protocol.py", ["tests/test_protocol.py"]),
    "app": ("ostinato/server/app.py", ["tests/test_app_routes.py"]),
    "engine_stop": ("ostinato/engine/engine.py", ["tests/test_engine.py"]),
    "plan": ("ostinato/graphs/plan.py", ["tests/test_graph_plan.py"]),
    "dispatcher": ("ostinato/graphs/dispatcher.py", ["tests/test_dispatcher.py"]),
    "compat": ("ostinato/graphs/compat.py", ["tests/test_compat.py"]),
    "block_manager": ("ostinato/engine/block_manager.py", ["tests/test_scheduler.py"]),
    "scheduler": ("ostinato/engine/scheduler.py", ["tests/test_scheduler.py"]),
    "detokenizer": ("ostinato/engine/detokenizer.py", ["tests/test_tokenizer.py"]),
    "lora_adapter": ("ostinato/lora/adapter.py", ["tests/test_lora_adapter.py"]),
    "graph_memory": ("ostinato/graphs/memory.py", ["tests/test_graph_plan.py"]),
    "sequence": ("ostinato/engine/sequence.py", ["tests/test_scheduler.py", "tests/test_step.py"]),
    "step": ("ostinato/runner/step.py", ["tests/test_step.py"]),
    "input_buffers": ("ostinato/runner/input_buffers.py", ["tests/test_input_buffers.py"]),
    "config": ("ostinato/config.py", ["tests/test_config.py"]),
    "layout": ("ostinato/layout.py", ["tests/test_layout.py"]),
    "quantization": ("ostinato/quantization.py", ["tests/test_quantization_spec.py"]),
    "triton_backend": ("ostinato/attention/triton_backend.py", ["tests/test_kernels.py"]),
    "footprint": ("ostinato/footprint.py", ["tests/test_explain.py"]),
    "engine_args": ("ostinato/engine_args.py", ["tests/test_engine_args.py"]),
    "lora_layer": ("ostinato/lora/layer.py", ["tests/test_lora_kernels.py"]),
    "linear_plan": (
        "ostinato/layers/linear.py",
        ["tests/test_models.py", "tests/test_lora_kernels.py", "tests/test_gemv.py"],
    ),
    "sampling_params": (
        "ostinato/sampling_params.py",
        ["tests/test_sampling_params_checks.py", "tests/test_sampling_params.py"],
    ),
    "bitmask": ("ostinato/structured/bitmask.py", ["tests/test_structured_outputs.py"]),
    "grammar": ("ostinato/structured/grammar.py", ["tests/test_structured_outputs.py"]),
    "explain": ("ostinato/graphs/explain.py", ["tests/test_explain.py"]),
    "modes": ("ostinato/graphs/modes.py", ["tests/test_compat.py", "tests/test_dispatcher.py"]),
    "bench": ("ostinato/bench.py", ["tests/test_bench.py", "tests/test_chain_floor.py"]),
    "tools": (
        "ostinato/server/tools.py",
        ["tests/test_tool_parsers.py", "tests/test_app_routes.py"],
    ),
    "metrics": (
        "ostinato/server/metrics.py",
        ["tests/test_metrics.py", "tests/test_app_routes.py"],
    ),
    "breakable": ("ostinato/graphs/breakable.py", ["tests/test_graph_capture.py"]),
    "capture": ("ostinato/graphs/capture.py", ["tests/test_graph_capture.py"]),
    "deadline": ("ostinato/runner/deadline.py", ["tests/test_distributed_safety.py"]),
    "variants": ("ostinato/kernels/variants.py", ["tests/test_graph_capture.py"]),
}

# module -> the methods (or module-level functions) mutated, where a module's name is one part
# of its file: every mutant of engine.py runs most of the engine tests, so the whole file would
# take hours; linear.py's loaders are the loader tests' (whole checkpoints)
METHODS: dict[str, list[str]] = {
    "engine_stop": ["_append_tokens", "_finish_reason", "_end", "abort_request"],
    "linear_plan": [
        "project",
        "normed_projection",
        "residual_projection",
        "fuses",
        "plan",
        "_new_plan",
        "_quantized_rows",
        "_fp8_norm_first",
        "_norm_first",
        "unsummed",
    ],
    "bench": [  # what the numbers come from; not the argument parser or the output
        "_timed_run",
        "_latency",
        "decode_floor_bytes",
        "num_parameters",
        "bench_startup",
        "_num_graphs",
        "_first_request",
        "bench_prefill",
        "_prefill_model_len",
        "_first_token_s",
        "copy_workload",
        "norepeat_workload",
    ],
}


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in [*MODULES, "--list"]:
        sys.exit(f"usage: python benchmarks/mutation.py {{{'|'.join(MODULES)}|--list}}")
    if sys.argv[1] == "--list":
        for name, (path, tests) in MODULES.items():
            methods = f" (methods {', '.join(METHODS[name])})" if name in METHODS else ""
            print(f"{name:14} {path:40} {' '.join(tests)}{methods}")
        return
    path, tests = MODULES[sys.argv[1]]
    methods = METHODS.get(sys.argv[1], [])
    names = [n for m in methods for n in (f"*ǁ{m}__mutmut_*", f"*.x_{m}__mutmut_*")]
    from mutmut import configuration
    from mutmut.__main__ import cli

    config = configuration.config()
    # the scripts some tests import (tests/test_chain_floor.py: benchmarks/chain_floor.py)
    scripts = sorted(Path("benchmarks").glob("*.py"))
    configuration._config = dataclasses.replace(
        config,
        only_mutate=[path],
        pytest_add_cli_args_test_selection=tests,
        also_copy=[*config.also_copy, *scripts],
    )
    shutil.rmtree("mutants", ignore_errors=True)
    Path("mutants/benchmarks").mkdir(parents=True)  # mutmut copies files, not their folders
    cli(["run", *names], standalone_mode=False)
    report(path, names)


def report(path: str, names: list[str]) -> None:
    from mutmut.stats import status_by_exit_code

    meta = json.loads(Path("mutants", path + ".meta").read_text())
    status = {
        k: status_by_exit_code[v]
        for k, v in meta["exit_code_by_key"].items()
        if not names or any(fnmatch.fnmatch(k, n) for n in names)
    }
    killed = sum(s in ("killed", "timeout") for s in status.values())
    print(f"\n{path}: {killed}/{len(status)} killed = {100 * killed / len(status):.1f}%")
    for name, s in sorted(status.items()):
        if s not in ("killed", "timeout"):
            print(f"  {s:10} {name}")


if __name__ == "__main__":
    main()
