"""Mutation score of one core module, with mutmut: the module alone is mutated and only its own
tests run against each mutant, so one module fits a developer's session.

    nice -n 10 python benchmarks/mutation.py sampler      # one module
    python benchmarks/mutation.py --list                   # the modules and their tests

It prints the score (killed + timeouts over all mutants) and the survivors; `mutmut show NAME`
prints a survivor's diff. Scores are recorded in benchmarks/mutation.md.
"""

from __future__ import annotations

import dataclasses
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
    "sampler": ("ostinato/runner/sampler.py", ["tests/test_sampler.py", "tests/test_rejection.py"]),
    "rejection": ("ostinato/speculative/rejection.py", ["tests/test_rejection.py"]),
    "ngram": ("ostinato/speculative/ngram.py", ["tests/test_ngram.py"]),
    "protocol": ("ostinato/server/protocol.py", ["tests/test_protocol.py"]),
    "app": ("ostinato/server/app.py", ["tests/test_server_fields.py"]),
    "engine_stop": (
        "ostinato/engine/engine.py",
        ["tests/test_engine.py", "tests/test_check_graphs.py"],
    ),
    "plan": ("ostinato/graphs/plan.py", ["tests/test_graph_plan.py"]),
    "dispatcher": ("ostinato/graphs/dispatcher.py", ["tests/test_dispatcher.py"]),
    "compat": ("ostinato/graphs/compat.py", ["tests/test_compat.py"]),
    "block_manager": ("ostinato/engine/block_manager.py", ["tests/test_scheduler.py"]),
    "scheduler": ("ostinato/engine/scheduler.py", ["tests/test_scheduler.py"]),
    "detokenizer": ("ostinato/engine/detokenizer.py", ["tests/test_tokenizer.py"]),
    "lora_adapter": ("ostinato/lora/adapter.py", ["tests/test_lora_adapter.py"]),
}


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in [*MODULES, "--list"]:
        sys.exit(f"usage: python benchmarks/mutation.py {{{'|'.join(MODULES)}|--list}}")
    if sys.argv[1] == "--list":
        for name, (path, tests) in MODULES.items():
            print(f"{name:14} {path:40} {' '.join(tests)}")
        return
    path, tests = MODULES[sys.argv[1]]
    from mutmut import configuration
    from mutmut.__main__ import cli

    configuration._config = dataclasses.replace(
        configuration.config(), only_mutate=[path], pytest_add_cli_args_test_selection=tests
    )
    shutil.rmtree("mutants", ignore_errors=True)
    cli(["run"], standalone_mode=False)
    report(path)


def report(path: str) -> None:
    from mutmut.stats import status_by_exit_code

    meta = json.loads(Path("mutants", path + ".meta").read_text())
    status = {k: status_by_exit_code[v] for k, v in meta["exit_code_by_key"].items()}
    killed = sum(s in ("killed", "timeout") for s in status.values())
    print(f"\n{path}: {killed}/{len(status)} killed = {100 * killed / len(status):.1f}%")
    for name, s in sorted(status.items()):
        if s not in ("killed", "timeout"):
            print(f"  {s:10} {name}")


if __name__ == "__main__":
    main()
