"""Prometheus text exposition (format 0.0.4), written by hand to avoid a dependency."""

from __future__ import annotations

import bisect
import threading
from collections import Counter

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# (metric, type, help, key of the engine stats); a key the engine does not report is skipped.
ENGINE_METRICS = (
    ("ostinato_requests_running", "gauge", "Requests in the running batch.", "num_running"),
    ("ostinato_requests_waiting", "gauge", "Requests waiting to be scheduled.", "num_waiting"),
    ("ostinato_prompt_tokens_total", "counter", "Prompt tokens processed.", "prompt_tokens_total"),
    (
        "ostinato_generation_tokens_total",
        "counter",
        "Tokens generated.",
        "generation_tokens_total",
    ),
    ("ostinato_kv_blocks_total", "gauge", "KV cache blocks.", "kv_blocks_total"),
    ("ostinato_kv_blocks_free", "gauge", "KV cache blocks free.", "kv_blocks_free"),
    ("ostinato_kv_blocks_used", "gauge", "KV cache blocks in use.", "kv_blocks_used"),
    (
        "ostinato_prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
        "prefix_cache_queries",
    ),
    (
        "ostinato_prefix_cache_hits_total",
        "counter",
        "Prompt tokens served by the prefix cache.",
        "prefix_cache_hits",
    ),
    (
        "ostinato_prefix_cache_hit_rate",
        "gauge",
        "Prefix cache hits over queries since start.",
        "prefix_cache_hit_rate",
    ),
    (
        "ostinato_spec_draft_tokens_total",
        "counter",
        "Draft tokens verified by speculative decoding.",
        "spec_draft_tokens",
    ),
    (
        "ostinato_spec_accepted_tokens_total",
        "counter",
        "Draft tokens accepted by speculative decoding.",
        "spec_accepted_tokens",
    ),
    (
        "ostinato_spec_acceptance_rate",
        "gauge",
        "Accepted over verified draft tokens since start.",
        "spec_acceptance_rate",
    ),
)


def _metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> list[str]:
    """HELP and TYPE lines, then one line per (suffix-and-labels, value) sample."""
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"] + [
        f"{name}{labels} {value}" for labels, value in samples
    ]


class Histogram:
    """Cumulative-bucket histogram; observe() is thread-safe (called on the engine thread)."""

    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_, buckets
        self._counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value

    def render(self) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        bounds = [str(b) for b in self.buckets] + ["+Inf"]
        cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
        samples = [(f'_bucket{{le="{b}"}}', c) for b, c in zip(bounds, cumulative, strict=True)]
        samples += [("_sum", total), ("_count", cumulative[-1])]
        return _metric(self.name, "histogram", self.help, samples)


class ServerMetrics:
    """What the server measures itself; the rest comes from the engine at scrape time."""

    def __init__(self) -> None:
        self.ttft = Histogram(
            "ostinato_time_to_first_token_seconds",
            "From arrival to the first generated token.",
            TTFT_BUCKETS,
        )
        self.tpot = Histogram(
            "ostinato_time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request.",
            TPOT_BUCKETS,
        )
        self._finished: Counter[str] = Counter()
        self._lock = threading.Lock()

    def observe_finish(self, reason: str, ttft: float | None, tpot: float | None) -> None:
        with self._lock:
            self._finished[reason] += 1
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)

    def render(self, stats: dict, graph_report: dict) -> str:
        """The whole exposition, from the engine's stats() and graph_report()."""
        lines = _engine_lines(_with_derived(stats))
        with self._lock:
            finished = sorted(self._finished.items())
        lines += _metric(
            "ostinato_requests_finished_total",
            "counter",
            "Requests ended, by finish reason.",
            [(f'{{finish_reason="{r}"}}', n) for r, n in finished],
        )
        lines += self.ttft.render() + self.tpot.render() + _graph_lines(graph_report)
        return "\n".join(lines) + "\n"


def _with_derived(stats: dict) -> dict:
    stats = dict(stats)
    if "kv_blocks_total" in stats and "kv_blocks_free" in stats:
        stats["kv_blocks_used"] = stats["kv_blocks_total"] - stats["kv_blocks_free"]
    if "prefix_cache_queries" in stats and "prefix_cache_hits" in stats:
        stats["prefix_cache_hit_rate"] = stats["prefix_cache_hits"] / max(
            stats["prefix_cache_queries"], 1
        )
    return stats


def _engine_lines(stats: dict) -> list[str]:
    lines = []
    for name, kind, help_, key in ENGINE_METRICS:
        if key in stats:
            lines += _metric(name, kind, help_, [("", stats[key])])
    return lines


def _graph_lines(report: dict) -> list[str]:
    """Graph-runtime metrics; absent until the runtime reports them."""
    lines = []
    if "steps" in report:
        samples = [(f'{{mode="{m}"}}', n) for m, n in sorted(report["steps"].items())]
        lines += _metric(
            "ostinato_graph_steps_total", "counter", "Steps run per graph runtime mode.", samples
        )
    if "padded_tokens" in report:
        lines += _metric(
            "ostinato_graph_padded_tokens_total",
            "counter",
            "Padding tokens run to fit captured graph sizes.",
            [("", report["padded_tokens"])],
        )
    return lines
