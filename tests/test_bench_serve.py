"""ostinato bench serve against the real server (a subprocess on loopback, the tiny model), and
its Poisson schedule."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from ostinato.bench_serve import (
    arrival_times,
    connected_users,
    engine_argv,
    launched_server,
    synthetic_requests,
)
from ostinato.cli import build_parser, main

METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


LAUNCH = ["bench", "serve", "--launch", "--model", "tiny", "--device", "cpu"]
LAUNCH += ["--max-model-len", "256", "--max-num-seqs", "64", "--no-prefix-caching"]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    """The server as --launch starts it (its engine flags passed on) and stops it."""
    log = tmp_path_factory.mktemp("bench-serve") / "server.log"
    with launched_server(build_parser().parse_args([*LAUNCH, "--server-log", str(log)])) as url:
        yield url
    with pytest.raises(httpx.TransportError):  # stopped
        httpx.get(f"{url}/health", timeout=2)
    assert "cuda graph mode: none" in log.read_text()  # its log went to --server-log


def test_launch_passes_the_engine_flags_given():
    flags = engine_argv(build_parser().parse_args([*LAUNCH, "--capture-sizes", "1,2"]))
    assert flags == ["--device", "cpu", "--max-num-seqs", "64", "--max-model-len", "256",
                     "--no-prefix-caching", "--capture-sizes", "1,2"]  # fmt: skip


def bench(capsys, *argv: str) -> list[dict]:
    assert main(["bench", "serve", "--model", "tiny", "--json", *argv]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_poisson_schedule_is_seeded_with_mean_gap_one_over_rate():
    times = arrival_times(20_000, rate=50.0, seed=3)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert times[0] == 0 and min(gaps) >= 0
    # the standard error of the mean gap is 0.7% here; seeded, so this never flakes
    assert abs(sum(gaps) / len(gaps) - 1 / 50) < 0.05 / 50
    assert arrival_times(20_000, 50.0, seed=3) == times != arrival_times(20_000, 50.0, seed=4)
    assert arrival_times(5, math.inf, seed=0) == [0.0] * 5
    with pytest.raises(ValueError, match="positive"):
        arrival_times(5, 0.0, seed=0)


def test_counts_and_ordered_percentiles_at_two_rates(server_url, capsys):
    argv = ["--base-url", server_url, "--num-prompts", "12", "--input-len", "8"]
    argv += ["--output-len", "6", "--len-spread", "0.5", "--request-rate", "20,inf"]
    lines = bench(capsys, *argv, "--logprobs", "0")
    assert [r["request_rate"] for r in lines] == [20.0, "inf"]
    for i, r in enumerate(lines):
        expected = sum(q.max_tokens for q in synthetic_requests(12, 8, 6, 0.5, 256, 1000 * i))
        assert (r["completed"], r["failed"], r["num_prompts"]) == (12, 0, 12)
        assert r["total_output_tokens"] == expected and "errors" not in r
        assert r["request_throughput"] == pytest.approx(12 / r["duration_s"])
        for m in METRICS:
            assert 0 <= r[f"{m}_p50"] <= r[f"{m}_p90"] <= r[f"{m}_p99"], (m, r)
            assert r[f"{m}_mean"] > 0
        assert r["ttft_ms_p99"] <= r["e2e_ms_p99"]
    # the schedule was kept: the run lasts at least until its last arrival
    assert lines[0]["duration_s"] >= max(arrival_times(12, 20.0, seed=0)) > 0.2


def test_dataset_prompts_and_max_tokens_are_used(server_url, capsys, tmp_path):
    rows = [{"prompt": "Hello", "max_tokens": 2}, {"prompt": [72, 105]}, {"prompt": "x"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(map(json.dumps, rows)) + "\n\n")
    (r,) = bench(capsys, "--base-url", server_url, "--dataset", str(path), "--output-len", "5")
    assert (r["completed"], r["num_prompts"], r["total_output_tokens"]) == (3, 3, 2 + 5 + 5)
    assert r["dataset"] == str(path)
    (r,) = bench(capsys, "--base-url", server_url, "--dataset", str(path), "--num-prompts", "2")
    assert (r["completed"], r["total_output_tokens"]) == (2, 2 + 128)


def test_refused_requests_and_a_dead_url_are_reported_not_raised(server_url, capsys, tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "Hi", "max_tokens": 3}, {"prompt": "x" * 300}, {"prompt": [10**6]}]
    path.write_text("\n".join(map(json.dumps, rows)))
    (r,) = bench(capsys, "--base-url", server_url, "--dataset", str(path))
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (1, 2, 3)
    assert sorted(r["errors"].values()) == [1, 1]
    assert any("HTTP 400" in e and "max_model_len is 256" in e for e in r["errors"])
    assert any("vocabulary" in e for e in r["errors"])
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    (r,) = bench(capsys, "--base-url", dead, "--num-prompts", "3")
    assert (r["completed"], r["failed"], r["ttft_ms_p50"]) == (0, 3, None)
    assert list(r["errors"]) == [next(iter(r["errors"]))] and "ConnectError" in next(
        iter(r["errors"])
    )


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("{nope", "line 2 is not JSON"),
        ('{"prompt": ""}', "line 2"),
        ('{"prompt": "a", "max_tokens": 0}', "max_tokens"),
    ],
)
def test_bad_dataset_lines_exit_2(capsys, tmp_path, line, words):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line)
    assert main(["bench", "serve", "--dataset", str(path)]) == 2
    assert words in capsys.readouterr().err


def test_percentiles_and_summary_against_values_worked_by_hand():
    from ostinato.bench_serve import Result, percentile, summarize

    values = [10.0, 20.0, 30.0, 40.0, 50.0]
    # rank (n - 1) * q / 100, linear between neighbours: p50 -> rank 2, p90 -> 3.6, p99 -> 3.96
    assert percentile(values, 50) == 30.0
    assert percentile(values, 90) == pytest.approx(46.0)
    assert percentile(values, 99) == pytest.approx(49.6)
    assert percentile(values, 0) == 10.0 and percentile(values, 100) == 50.0
    assert percentile([7.0], 99) == 7.0
    results = [
        Result(token_times=[0.1, 0.2, 0.4], latency=0.4, output_tokens=3),
        Result(token_times=[0.3], latency=0.3, output_tokens=1),
        Result(error="HTTP 400: no"),
    ]
    r = summarize(results, seconds=2.0)
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (2, 1, 4)
    assert r["request_throughput"] == 1.0 and r["output_tokens_per_s"] == 2.0
    assert r["ttft_ms_mean"] == pytest.approx(200.0) and r["ttft_ms_p50"] == pytest.approx(200.0)
    # TPOT only for requests of 2+ tokens: (0.4 - 0.1) / 2 = 150 ms
    assert r["tpot_ms_mean"] == pytest.approx(150.0) and r["tpot_ms_p99"] == pytest.approx(150.0)
    assert r["itl_ms_p50"] == pytest.approx(150.0)  # gaps of 100 and 200 ms
    assert r["itl_ms_p90"] == pytest.approx(190.0)
    assert r["e2e_ms_mean"] == pytest.approx(350.0) and r["errors"] == {"HTTP 400: no": 1}


def test_each_user_is_connected_before_the_load_starts():
    """connected_users opens one connection per simulated user and sends its first request
    there, so no clock of the load runs while a connection is set up."""

    async def main() -> tuple[int, list[bytes]]:
        seen: list[bytes] = []

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()
            await reader.read()  # keep the connection until the client closes it
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            users = await connected_users(f"http://127.0.0.1:{port}", 3)
            opened = len(seen)
            await asyncio.gather(*(user.aclose() for user in users))
        return opened, seen

    opened, requests = asyncio.run(main())
    assert opened == 3 and all(r.startswith(b"GET /v1/models ") for r in requests)


def test_the_serving_path_benchmark_times_each_layer(tmp_path):
    """benchmarks/serve_path.py (the real HTTP process and client around a scripted core) runs,
    and each layer's time to first token contains the one inside it: the core's clock starts
    after the HTTP process's and stops before it, the client's outside both."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).parent.parent / "benchmarks" / "serve_path.py"
    run = subprocess.run(
        [sys.executable, str(script), "--port", str(port), "--num-prompts", "6",
         "--input-len", "64", "--output-len", "4", "--prefill-ms", "20"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": "."},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    core, server = result["core_ttft_ms"]["mean"], result["server_ttft_mean_ms"]
    assert 0 < core < server < result["client"]["ttft_ms_mean"]
