"""The Prometheus exposition the server writes, read back sample by sample."""

from __future__ import annotations

import pytest

from ostinato.server.metrics import ServerMetrics


def samples(text: str) -> dict[str, float]:
    """{name and labels: value} of an exposition's sample lines."""
    lines = [line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#")]
    return {key: float(value) for key, value in lines}


def buckets(values: dict[str, float], name: str) -> list[tuple[str, float]]:
    return [(k.split('le="')[1][:-2], v) for k, v in values.items() if k.startswith(name + "_b")]


def test_the_exposition_holds_the_engine_the_finished_requests_and_the_graphs():
    """Engine stats as gauges and counters (blocks in use and the prefix hit rate derived),
    each metric with its type and a help text, finished requests by reason, TTFT and TPOT
    histograms whose buckets count values at or below their bound, cumulatively, and the
    graph runtime's steps by mode and its padding."""
    metrics = ServerMetrics()
    metrics.observe_finish("stop", 0.02, 0.004)
    metrics.observe_finish("stop", 0.01, None)  # on a bound: counted in its bucket
    metrics.observe_finish("length", None, 0.005)
    metrics.observe_finish("abort", 90.0, 0.0005)
    stats = dict(num_running=2, num_waiting=1, kv_blocks_total=10, kv_blocks_free=4,
                 prefix_cache_queries=8, prefix_cache_hits=2, spec_draft_tokens=5,
                 spec_accepted_tokens=3, spec_acceptance_rate=0.6)  # fmt: skip
    report = {"steps": {"full": 5, "eager": 2}, "padded_tokens": 7}
    text = metrics.render(stats, report)
    values = samples(text)
    assert values["ostinato_requests_running"] == 2 and values["ostinato_requests_waiting"] == 1
    assert values["ostinato_kv_blocks_used"] == 6 and values["ostinato_kv_blocks_free"] == 4
    assert values["ostinato_prefix_cache_hit_rate"] == 0.25
    assert values["ostinato_prefix_cache_queries_total"] == 8
    assert values["ostinato_spec_acceptance_rate"] == 0.6
    assert values['ostinato_requests_finished_total{finish_reason="stop"}'] == 2
    assert values['ostinato_requests_finished_total{finish_reason="length"}'] == 1
    ttft = "ostinato_time_to_first_token_seconds"
    assert buckets(values, ttft) == [("0.005", 0), ("0.01", 1), ("0.025", 2), ("0.05", 2),
                                     ("0.1", 2), ("0.25", 2), ("0.5", 2), ("1.0", 2), ("2.5", 2),
                                     ("5.0", 2), ("10.0", 2), ("30.0", 2), ("60.0", 2),
                                     ("+Inf", 3)]  # fmt: skip
    assert values[ttft + "_count"] == 3 and values[ttft + "_sum"] == pytest.approx(90.03)
    tpot = "ostinato_time_per_output_token_seconds"
    assert [n for _, n in buckets(values, tpot)] == [1, 1, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]
    assert values[tpot + "_count"] == 3 and values[tpot + "_sum"] == pytest.approx(0.0095)
    assert values['ostinato_graph_steps_total{mode="eager"}'] == 2
    assert values['ostinato_graph_steps_total{mode="full"}'] == 5
    assert values["ostinato_graph_padded_tokens_total"] == 7
    for line in ("# TYPE ostinato_requests_running gauge",
                 "# TYPE ostinato_spec_draft_tokens_total counter",
                 f"# TYPE {ttft} histogram", f"# TYPE {tpot} histogram",
                 "# TYPE ostinato_requests_finished_total counter",
                 "# HELP ostinato_kv_blocks_used KV cache blocks in use.",
                 "# TYPE ostinato_graph_steps_total counter",
                 "# TYPE ostinato_graph_padded_tokens_total counter"):  # fmt: skip
        assert line in text.splitlines()
    helps = [line.split(" ", 3) for line in text.splitlines() if line.startswith("# HELP")]
    names = {k.split("{")[0].removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
             for k in values}  # fmt: skip
    assert {name for _, _, name, _ in helps} == names
    assert all(len(help_) > 10 and help_ != "None" for *_, help_ in helps)
    assert text.index('mode="eager"') < text.index('mode="full"') and text.endswith("\n")


def test_what_the_engine_does_not_report_is_left_out():
    """Stats without the pair a derived gauge needs give no derived gauge; no prefix queries
    give a hit rate of 0, one query hit once a rate of 1; a graph report without steps or
    padding gives no graph lines; no finished request gives empty histograms."""
    values = samples(ServerMetrics().render({"kv_blocks_total": 10}, {}))
    assert "ostinato_kv_blocks_used" not in values and values["ostinato_kv_blocks_total"] == 10
    assert not any(k.startswith(("ostinato_prefix", "ostinato_graph")) for k in values)
    assert values["ostinato_time_to_first_token_seconds_count"] == 0
    for queries, hits, rate in ((0, 0, 0.0), (1, 1, 1.0)):
        stats = {"prefix_cache_queries": queries, "prefix_cache_hits": hits}
        values = samples(ServerMetrics().render(stats, {}))
        assert values["ostinato_prefix_cache_hit_rate"] == rate
    values = samples(ServerMetrics().render({"prefix_cache_queries": 3}, {}))
    assert values["ostinato_prefix_cache_queries_total"] == 3
    assert "ostinato_prefix_cache_hit_rate" not in values
