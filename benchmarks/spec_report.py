"""Inter-token latency with and without speculative decoding, against issue 12's targets.

    python benchmarks/spec_report.py spec.jsonl   # lines of `ostinato bench latency --json`

Pairs each speculative result with the plain one of the same model, workload and batch size,
and prints a Markdown table: copy-heavy must be >= 1.5x faster, no-repeat <= 5% slower.
"""

from __future__ import annotations

import json
import sys

TARGETS = {  # workload: (speed-up at least, its wording)
    "copy": (1.5, ">= 1.5x faster"),
    "norepeat": (1 / 1.05, "<= 5% slower"),
}


def report(lines: list[dict]) -> str:
    plain = {_key(r): r for r in lines if not r.get("num_speculative_tokens")}
    rows = [
        "| model | workload | batch | k | plain TPOT ms | spec TPOT ms | speed-up | acceptance "
        "| target | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in lines:
        base = plain.get(_key(r))
        if not r.get("num_speculative_tokens") or base is None:
            continue
        speedup = base["tpot_ms"] / r["tpot_ms"]
        least, wording = TARGETS.get(r["workload"], (None, "-"))
        verdict = "-" if least is None else ("met" if speedup >= least else "missed")
        rows.append(
            f"| {r['model']} | {r['workload']} | {r['batch_size']} "
            f"| {r['num_speculative_tokens']} | {base['tpot_ms']:.3f} | {r['tpot_ms']:.3f} "
            f"| {speedup:.2f}x | {r['spec_acceptance_rate']:.2f} | {wording} | {verdict} |"
        )
    return "\n".join(rows)


def _key(r: dict) -> tuple:
    return r["model"], r["workload"], r["batch_size"], r["mode"]


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(report([json.loads(line) for line in f if line.strip()]))
