"""What the serving path adds to time to first token, without a GPU.

The real HTTP process (FastAPI, uvicorn, SSE, the engine client's detokenisation and output
handling, ZeroMQ and msgpack) in front of a scripted engine core that runs the real EngineCore
loop over an engine made of a timetable: every step decodes one token for each running request
and prefills up to --tokens-per-step prompt tokens first come first served, and takes
--decode-ms plus --prefill-ms per 8,192 prefilled tokens. `ostinato bench serve` loads it.

Each request's time to first token is then measured three times: by the core (from taking the
request to the end of the step that made its first token), by the HTTP process (/metrics: from
arrival to handling that step's message) and by the client (from sending to reading the first
chunk). The differences are what the serving path costs.

    PYTHONPATH=. python3 benchmarks/serve_path.py --num-prompts 80 --input-len 512 \
        --output-len 128 --len-spread 0.5 --logprobs 0

The defaults are qwen3-0.6b's on an H100 (session 24): 8,192-token prefill steps of ~33 ms and
decode steps of ~2.5 ms at batch 80.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

from ostinato.outputs import RequestOutput

MODEL = "random:qwen3-0.6b"
TIMETABLE_ENV = "OSTINATO_SERVE_PATH_TIMETABLE"  # the scripted core's arguments, as JSON
BENCH_TIMEOUT = 600  # seconds the load may take before the measurement fails


@dataclass
class _Scripted:
    request_id: str
    prompt_left: int
    max_tokens: int
    logprobs: bool
    taken: float
    token_ids: list[int] = field(default_factory=list)
    logprob_rows: list[dict[int, float]] = field(default_factory=list)


class TimetableEngine:
    """The parts of LLMEngine that EngineCore uses, with steps that follow a timetable."""

    def __init__(self, decode_ms: float, prefill_ms: float, tokens_per_step: int, out: str):
        self.decode_s, self.prefill_s = decode_ms / 1e3, prefill_ms / 1e3
        self.tokens_per_step = tokens_per_step
        self.out = out
        self.config = SimpleNamespace(max_waiting_requests=10**6)
        self.executor = SimpleNamespace(num_blocks=10**6)
        self.failed = None
        self.requests: dict[str, _Scripted] = {}
        self.waiting: deque[_Scripted] = deque()
        self.running: list[_Scripted] = []
        self.core_ttft: list[float] = []

    def add_request(self, prompt_token_ids, params, request_id, lora=None) -> None:
        req = _Scripted(
            request_id, len(prompt_token_ids), params.max_tokens, params.logprobs is not None,
            time.monotonic(),
        )  # fmt: skip
        self.requests[request_id] = req
        self.waiting.append(req)

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.waiting = deque(r for r in self.waiting if r is not req)
            self.running = [r for r in self.running if r is not req]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        budget = self.tokens_per_step - len(self.running)
        prefilled, done = 0, []
        while self.waiting and budget > 0:
            chunk = min(budget, self.waiting[0].prompt_left)
            self.waiting[0].prompt_left -= chunk
            prefilled, budget = prefilled + chunk, budget - chunk
            if self.waiting[0].prompt_left == 0:
                done.append(self.waiting.popleft())
        time.sleep(self.decode_s + self.prefill_s * prefilled / 8192)
        now = time.monotonic()
        self.core_ttft += [now - r.taken for r in done]
        self.running += done
        outputs = [self._next_token(r) for r in self.running]
        self.running = [r for r in self.running if len(r.token_ids) < r.max_tokens]
        return outputs

    def _next_token(self, req: _Scripted) -> RequestOutput:
        token = 97 + len(req.token_ids) % 26  # a letter: every token adds visible text
        req.token_ids.append(token)
        if req.logprobs:
            req.logprob_rows.append({token: -0.5})
        finished = len(req.token_ids) >= req.max_tokens
        if finished:
            del self.requests[req.request_id]
        return RequestOutput(
            req.request_id, [], list(req.token_ids), "", [token], finished,
            "length" if finished else None, None,
            list(req.logprob_rows) if req.logprobs else None,
        )  # fmt: skip

    def stats(self) -> dict:
        return {"num_waiting": len(self.waiting), "num_running": len(self.running)}

    def graph_report(self) -> dict:
        return {}

    def shutdown(self) -> None:
        with open(self.out, "w") as f:
            json.dump({"core_ttft_s": self.core_ttft}, f)


def scripted_core(config, adapters, input_address, output_address, parent) -> None:
    """core_main with the timetable engine in place of LLMEngine."""
    import zmq

    from ostinato.distributed.worker import die_with
    from ostinato.engine import messages as m
    from ostinato.engine.core import EngineCore

    die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.connect(output_address)
    engine = TimetableEngine(**json.loads(os.environ[TIMETABLE_ENV]))
    core = EngineCore(engine, inputs, outputs)
    signal.signal(signal.SIGTERM, lambda *_: setattr(core, "stopping", True))
    outputs.send(m.encoder().encode(m.Ready(engine.executor.num_blocks)))
    try:
        code = core.run()
    finally:
        engine.shutdown()
    context.destroy(linger=1000)
    sys.exit(code)


def serve(port: int) -> None:
    """The HTTP process: `ostinato serve`'s, with the scripted core."""
    import uvicorn

    from ostinato.config import EngineConfig
    from ostinato.engine.core_client import EngineCoreClient
    from ostinato.server.app import build_app

    engine = EngineCoreClient(EngineConfig(model=MODEL, device="cpu"), core=scripted_core)
    try:
        uvicorn.run(build_app(engine, [MODEL]), port=port, log_level="warning")
    finally:
        engine.close()


def _get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=5).read().decode()


def _wait_healthy(base: str, proc: subprocess.Popen) -> None:
    for _ in range(300):
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            _get(base + "/health")
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the server did not become healthy in 30 s")


def _server_ttft_mean(metrics: str) -> float:
    values = {}
    for line in metrics.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("ostinato_time_to_first_token_seconds_"):
            values[name.rsplit("_", 1)[1]] = float(value)
    return values["sum"] / max(values["count"], 1)


def _stop(server: subprocess.Popen) -> None:
    """SIGINT (the server stops its core and exits), then SIGKILL if it has not within 30 s:
    the core dies with it (PR_SET_PDEATHSIG), so nothing outlives the measurement."""
    server.send_signal(signal.SIGINT)
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _rounded(value: float | None) -> float | None:
    """bench serve's statistic to 0.01; None (a distribution with no values) stays None."""
    return value if value is None else round(value, 2)


def _ms(values: list[float]) -> dict:
    return {
        "mean": round(statistics.fmean(values) * 1e3, 1),
        "p50": round(statistics.median(values) * 1e3, 1),
    }


def measure(args: argparse.Namespace, bench_args: list[str]) -> dict:
    """One server, one `bench serve` run against it; the three TTFTs."""
    with tempfile.TemporaryDirectory() as tmp:
        core_out = os.path.join(tmp, "core.json")
        timetable = {
            "decode_ms": args.decode_ms, "prefill_ms": args.prefill_ms,
            "tokens_per_step": args.tokens_per_step, "out": core_out,
        }  # fmt: skip
        env = {**os.environ, TIMETABLE_ENV: json.dumps(timetable)}
        base = f"http://127.0.0.1:{args.port}"
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", "--port", str(args.port)], env=env
        )
        try:
            _wait_healthy(base, server)
            bench = subprocess.run(
                [sys.executable, "-m", "ostinato.cli", "bench", "serve", "--model", MODEL,
                 "--base-url", base, "--json", *bench_args],
                env=env, capture_output=True, text=True, timeout=BENCH_TIMEOUT,
            )  # fmt: skip
            if bench.returncode != 0:  # e.g. a bad bench flag: bench serve's own message
                raise SystemExit(f"serve_path.py: bench serve failed: {bench.stderr.strip()}")
            client = json.loads(bench.stdout.strip().splitlines()[-1])
            server_mean = _server_ttft_mean(_get(base + "/metrics"))
        finally:
            _stop(server)
        with open(core_out) as f:
            core = json.load(f)["core_ttft_s"]
    return {
        "core_ttft_ms": _ms(core),
        "server_ttft_mean_ms": round(server_mean * 1e3, 1),
        "client": {k: _rounded(v) for k, v in client.items() if k[:4] in ("ttft", "itl_")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=8137)
    parser.add_argument("--decode-ms", type=float, default=2.5, help="a step's fixed cost")
    parser.add_argument("--prefill-ms", type=float, default=33.0, help="per 8,192 tokens")
    parser.add_argument("--tokens-per-step", type=int, default=8192)
    parser.add_argument("--label", default="", help="a tag for this tree")
    args, bench_args = parser.parse_known_args()
    if args.serve:
        serve(args.port)
        return
    result = {"label": args.label, "bench_args": bench_args, **measure(args, bench_args)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
