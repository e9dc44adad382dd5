"""ostinato bench serve: an online benchmark against an OpenAI-compatible server.

Requests arrive as a Poisson process at each --request-rate (inf: all at once) and stream from
/v1/completions. Each rate reports request and output-token throughput, and time to first
token, time per output token, inter-token latency and end-to-end latency (mean, p50, p90, p99).
A failed request (refused, broken off, timed out) is counted and its error reported; it never
stops the run. With --launch the command starts `ostinato serve` with its engine flags, waits
for /health, runs, and stops the server.

Each simulated user (up to MAX_USERS, then shared in turn) has its own HTTP client, connected
before the clocks start. Times are those of the streamed chunks. A server streams text, so a
token that adds no visible text (a byte tokenizer's cut character, or a random-weight preset's
ids past its byte tokenizer) arrives with a later chunk; --logprobs 0 makes every token its own
chunk while the client keeps up (ostinato sends one per token when logprobs are asked, and
merges the tokens of a stream that fell behind into one chunk), so the first chunk is the
first token, and inter-token latency is the time between chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import httpx
from tqdm import tqdm

MAX_USERS = 256  # HTTP clients of one load; more requests at once share them


@dataclass(frozen=True)
class Request:
    prompt: str | list[int]
    max_tokens: int


@dataclass
class Result:
    """One request: token arrival times in seconds from its start (empty when it failed)."""

    error: str | None = None
    token_times: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


# ---- the command line ------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to load")
    parser.add_argument(
        "--request-rate",
        type=_rates,
        default=[math.inf],
        help="requests per second, comma-separated; inf sends all at once (default inf)",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="requests per rate (100; a dataset: all)"
    )
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens (default 128)")
    parser.add_argument(
        "--len-spread",
        type=float,
        default=0.0,
        help="lengths uniform in len*(1 -+ spread) (default 0: exact)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=256,
        help="random prompt token ids are below this (default 256: valid for every model)",
    )
    parser.add_argument(
        "--dataset", default=None, help='JSONL file, one {"prompt": ..., "max_tokens": ...} a line'
    )
    parser.add_argument(
        "--logprobs", type=int, default=None, help="ask each token's logprobs (see above)"
    )
    parser.add_argument("--bench-seed", type=int, default=0, help="seeds arrivals and prompts")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds one request may take (default 600)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per rate")
    parser.add_argument(
        "--launch", action="store_true", help="start `ostinato serve` with the engine flags"
    )
    parser.add_argument(
        "--launch-timeout", type=float, default=900.0, help="seconds to wait for /health"
    )
    parser.add_argument("--server-log", default=None, help="launched server's log (a temp file)")


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x]
    except ValueError:
        rates = []
    if not rates or min(rates) <= 0 or any(math.isnan(r) for r in rates):
        raise argparse.ArgumentTypeError(f"expected positive rates like 1,4,inf, got {text!r}")
    return rates


def run(args: argparse.Namespace) -> int:
    from ostinato.bench import emit_result

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    requests = _requests(args)
    launch = launched_server(args) if args.launch else contextlib.nullcontext(args.base_url)
    try:
        with launch as base_url:
            for i, rate in enumerate(args.request_rate):
                if args.dataset is None and i:  # new prompts per rate: no prefix-cache hits
                    requests = _requests(args, seed_offset=i)
                results, seconds = asyncio.run(benchmark(base_url, args, requests, rate, i))
                head = {"bench": "serve", "model": args.model, "base_url": base_url}
                if args.launch:  # the launched server's engine flags
                    head["engine_flags"] = " ".join(engine_argv(args))
                head |= {"request_rate": "inf" if math.isinf(rate) else rate}
                head |= {"dataset": args.dataset, "num_prompts": len(requests)}
                emit_result(head | summarize(results, seconds), args.json)
    except ServerError as e:
        print(f"ostinato: error: {e}", file=sys.stderr)
        return 1
    return 0


def _requests(args: argparse.Namespace, seed_offset: int = 0) -> list[Request]:
    if args.dataset is not None:
        return load_dataset(args.dataset, args.num_prompts, args.output_len)
    for name in ("input_len", "output_len", "vocab_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.len_spread < 1:
        raise ValueError(f"--len-spread must be in [0, 1), got {args.len_spread}")
    return synthetic_requests(
        args.num_prompts or 100,
        args.input_len,
        args.output_len,
        args.len_spread,
        args.vocab_size,
        seed=args.bench_seed + 1000 * seed_offset,
    )


# ---- workload --------------------------------------------------------------------------------
def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of n requests is sent: a Poisson process of `rate`
    requests per second (independent exponential gaps of mean 1/rate), or all at 0 for inf."""
    if not rate > 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def synthetic_requests(
    n: int, input_len: int, output_len: int, spread: float, vocab_size: int, seed: int
) -> list[Request]:
    """n prompts of random token ids with lengths uniform in len*(1 -+ spread)."""
    rng = random.Random(seed)

    def length(mean: int) -> int:
        low = max(1, round(mean * (1 - spread)))
        return rng.randint(low, max(low, round(mean * (1 + spread))))

    return [
        Request([rng.randrange(vocab_size) for _ in range(length(input_len))], length(output_len))
        for _ in range(n)
    ]


def load_dataset(path: str, limit: int | None, default_max_tokens: int) -> list[Request]:
    """Requests from a JSONL file: {"prompt": text or token ids, "max_tokens": n} per line
    (max_tokens defaults to --output-len); the first `limit` of them when given."""
    requests = []
    lines = Path(path).read_text().splitlines()  # FileNotFoundError names the path
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not JSON ({e.msg}): give one object a line") from None
        prompt = row.get("prompt") if isinstance(row, dict) else None
        max_tokens = row.get("max_tokens", default_max_tokens) if isinstance(row, dict) else 0
        is_ids = isinstance(prompt, list) and all(type(t) is int for t in prompt)
        if not prompt or not (isinstance(prompt, str) or is_ids):
            raise ValueError(f'{where}: "prompt" must be non-empty text or a list of token ids')
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f'{where}: "max_tokens" must be a positive integer')
        requests.append(Request(prompt, max_tokens))
    if not requests:
        raise ValueError(f"{path} holds no prompts: write one JSON object a line")
    return requests[:limit] if limit else requests


# ---- the load --------------------------------------------------------------------------------
async def benchmark(
    base_url: str, args: argparse.Namespace, requests: list[Request], rate: float, index: int
) -> tuple[list[Result], float]:
    """Send every request at its arrival time; the results and the seconds it all took."""
    times = arrival_times(len(requests), rate, args.bench_seed + index)
    bar = tqdm(total=len(requests), desc=f"rate {rate:g}/s", disable=None)
    users = await connected_users(base_url, min(len(requests), MAX_USERS))
    try:
        start = time.perf_counter()

        async def one(i: int, request: Request, at: float) -> Result:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            user = users[i % len(users)]
            result = await send(user, args.model, request, args.logprobs, args.timeout)
            bar.update(1)
            return result

        load = enumerate(zip(requests, times, strict=True))
        results = await asyncio.gather(*(one(i, r, t) for i, (r, t) in load))
        seconds = time.perf_counter() - start
    finally:
        await asyncio.gather(*(user.aclose() for user in users))
    bar.close()
    return list(results), seconds


async def connected_users(base_url: str, count: int) -> list[httpx.AsyncClient]:
    """One client per simulated user, its connection opened (GET /v1/models) before any clock
    starts, as users of a server each hold their own. One client's pool shared by a burst
    set up its connections, and scheduled requests onto them, while the clocks ran: the last
    of 80 requests left tens of milliseconds after the first."""
    users = [httpx.AsyncClient(base_url=base_url, timeout=None) for _ in range(count)]

    async def connect(user: httpx.AsyncClient) -> None:
        with contextlib.suppress(httpx.HTTPError):  # a failing server fails the load itself
            await user.get("/v1/models")

    await asyncio.gather(*(connect(user) for user in users))
    return users


async def send(
    client: httpx.AsyncClient,
    model: str,
    request: Request,
    logprobs: int | None,
    timeout: float,
) -> Result:
    """One streamed completion of exactly max_tokens tokens (ignore_eos, an extension that
    ostinato and vLLM accept); any failure is returned, not raised."""
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if logprobs is not None:
        body["logprobs"] = logprobs
    result, start = Result(), time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            await _stream(client, body, result, start)
    except TimeoutError:
        result.error = f"timed out after {timeout:g} s"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    result.latency = time.perf_counter() - start
    if result.ok and not result.token_times:
        result.error = "the stream ended without a token"
    return result


async def _stream(client: httpx.AsyncClient, body: dict, result: Result, start: float) -> None:
    tokens, usage = 0, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {_message(await response.aread())}"
            return
        async for line in response.aiter_lines():
            data = line.removeprefix("data:").strip() if line.startswith("data:") else None
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = f"stream error: {chunk['error'].get('message')}"
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                if choice.get("text") or choice.get("logprobs") or choice.get("finish_reason"):
                    result.token_times.append(time.perf_counter() - start)
                    tokens += _tokens_in(choice)
    result.output_tokens = usage["completion_tokens"] if usage else tokens


def _tokens_in(choice: dict) -> int:
    """Tokens a chunk carries, for servers that send no usage: its logprobs count them."""
    logprobs = choice.get("logprobs") or {}
    return len(logprobs["tokens"]) if logprobs.get("tokens") is not None else 1


def _message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:200]


# ---- the report ------------------------------------------------------------------------------
def summarize(results: list[Result], seconds: float) -> dict:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    report = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": seconds,
        "request_throughput": len(ok) / seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "total_output_tokens": output_tokens,
    }
    series = {
        "ttft_ms": [r.token_times[0] for r in ok],
        "tpot_ms": [
            (r.latency - r.token_times[0]) / (r.output_tokens - 1)
            for r in ok
            if r.output_tokens > 1
        ],
        "itl_ms": [b - a for r in ok for a, b in pairwise(r.token_times)],
        "e2e_ms": [r.latency for r in ok],
    }
    for name, values in series.items():
        report |= {f"{name}_{k}": v for k, v in distribution([v * 1e3 for v in values]).items()}
    errors = Counter(r.error for r in results if not r.ok)
    if errors:
        report["errors"] = dict(errors.most_common(5))
    return report


def distribution(values: list[float]) -> dict[str, float | None]:
    """Mean and the 50th, 90th and 99th percentiles (linear between ranks); None when empty."""
    values = sorted(values)
    stats: dict[str, float | None] = {"mean": sum(values) / len(values) if values else None}
    for q in (50, 90, 99):
        stats[f"p{q}"] = percentile(values, q) if values else None
    return stats


def percentile(sorted_values: list[float], q: float) -> float:
    rank = (len(sorted_values) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


# ---- --launch --------------------------------------------------------------------------------
class ServerError(RuntimeError):
    """The launched server did not come up."""


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags given to this command, as `ostinato serve` takes them."""
    argv = []
    for action in args.engine_actions:
        value, flag = getattr(args, action.dest), action.option_strings[0]
        if value == action.default:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
        else:
            argv += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return argv


@contextlib.contextmanager
def launched_server(args: argparse.Namespace) -> Iterator[str]:
    """`ostinato serve` on a free loopback port, healthy; stopped with SIGTERM afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = Path(args.server_log or tempfile.mkstemp(prefix="ostinato-serve-", suffix=".log")[1])
    command = [sys.executable, "-m", "ostinato.server", *engine_argv(args)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning"]
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(url, proc, args.launch_timeout, log)
        print(f"server up at {url} (log: {log})", file=sys.stderr)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(
                f"the server exited ({proc.returncode}) before /health answered; "
                f"its log ({log}) ends:\n{_tail(log)}"
            )
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.25)
    raise ServerError(
        f"/health did not answer in {timeout:g} s (raise --launch-timeout); the log ({log}) "
        f"ends:\n{_tail(log)}"
    )


def _tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
