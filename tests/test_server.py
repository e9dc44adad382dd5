"""The OpenAI-compatible server, run for real as a subprocess on loopback with the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers import assert_all_gone, child_pids, descendants

from ostinato import LLM, SamplingParams
from ostinato.config import EngineConfig

MAX_MODEL_LEN = 256
CONFIG = {"model": "tiny", "device": "cpu", "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 64}
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
EXACT = {"ignore_eos": True}  # extension: exactly max_tokens tokens


def _flags(config: dict) -> list[str]:
    return [x for k, v in config.items() for x in (f"--{k.replace('_', '-')}", str(v))]


class Server:
    """`python -m ostinato.server` on a free port; ready once /health answers."""

    def __init__(self, flags: list[str], log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        command = [sys.executable, "-m", "ostinato.server", *flags, "--port", str(port)]
        with log.open("w") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        self._wait_healthy(timeout=60)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited:\n{self.log.read_text()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise AssertionError(f"server not healthy in {timeout}s:\n{self.log.read_text()}")

    def stop(self) -> int:
        """SIGTERM, then the exit status (killed after a timeout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
        return {name: float(value) for name, value in samples}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(_flags(CONFIG), tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def llm():
    return LLM(config=EngineConfig(**CONFIG))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def _greedy(llm: LLM, prompts: list, max_tokens: int) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.text for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_batch_matches_llm_generate(client, llm):
    r = client.completions.create(
        model="tiny", prompt=PROMPTS, max_tokens=16, temperature=0, extra_body=EXACT
    )
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == _greedy(llm, PROMPTS, 16)


def test_completion_usage_and_stream(client, llm):
    tokens = len(llm.tokenizer.encode(PROMPTS[0]))
    kwargs = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    r = client.completions.create(**kwargs, extra_body=EXACT)
    assert r.choices[0].text == _greedy(llm, PROMPTS[:1], 8)[0]
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (tokens, 8)
    assert r.usage.total_tokens == tokens + 8
    chunks = list(
        client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}, extra_body=EXACT
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == r.usage


def test_chat_usage_and_stream(client, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = llm.tokenizer.apply_chat_template(messages)
    kwargs = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
    r = client.chat.completions.create(**kwargs, extra_body=EXACT)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == _greedy(llm, [prompt], 8)[0]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 8)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}, extra_body=EXACT
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage == r.usage


def test_stop_string_is_cut_from_streams_too(client, llm):
    full = _greedy(llm, PROMPTS[1:2], 24)[0]
    stop = full[6:8]
    kwargs = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0}
    r = client.completions.create(**kwargs, stop=[stop], extra_body=EXACT)
    assert r.choices[0].text == full[: full.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(**kwargs, stop=stop, stream=True, extra_body=EXACT)
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_logprobs_n_and_seed(client):
    r = client.completions.create(model="tiny", prompt="Hi", max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) == 2 for top in lp.top_logprobs) and max(lp.token_logprobs) <= 0
    messages = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, logprobs=True, top_logprobs=3
    )
    assert all(len(t.top_logprobs) == 3 for t in r.choices[0].logprobs.content)

    def sample() -> list[str]:
        kwargs = {"model": "tiny", "prompt": "Hi", "max_tokens": 12, "n": 3, "seed": 7}
        r = client.completions.create(**kwargs, temperature=1.0, extra_body=EXACT)
        assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 36
        return [c.text for c in r.choices]

    first = sample()
    assert sample() == first and len(set(first)) > 1


BAD_REQUESTS = [  # (path, body changes, status, param, words the message must hold)
    ("completions", {"temperature": -1}, 400, "temperature", "temperature"),
    ("completions", {"top_p": 2}, 400, "top_p", "top_p"),
    ("completions", {"top_k": 0}, 400, "top_k", "top_k"),
    ("completions", {"max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ("completions", {"n": 0}, 400, "n", "n"),
    ("completions", {"logprobs": 99}, 400, "logprobs", "logprobs"),
    ("completions", {"stop": [""]}, 400, "stop", "stop"),
    ("completions", {"prompt": None}, 400, "prompt", "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("completions", {"prompt": "x" * 300}, 400, "prompt", "max_model_len"),
    ("completions", {"prompt": [10**6]}, 400, "prompt", "vocabulary"),
    ("completions", {"model": "gpt-4"}, 404, "model", "gpt-4"),
    ("chat/completions", {"messages": []}, 400, "messages", "messages"),
    ("chat/completions", {"messages": [{"role": "user"}] * 300}, 400, "messages", "max_model_len"),
    ("chat/completions", {"top_logprobs": -1}, 400, "top_logprobs", "top_logprobs"),
]


@pytest.mark.parametrize(("path", "change", "status", "param", "words"), BAD_REQUESTS)
def test_bad_request_is_refused_clearly(server, client, path, change, status, param, words):
    body = {"model": "tiny", "max_tokens": 4}
    body |= {"prompt": "Hi"} if path == "completions" else {"messages": [{"role": "user"}]}
    r = httpx.post(f"{server.url}/v1/{path}", json=body | change, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices


def test_malformed_json_and_unknown_model_through_the_client(server, client):
    headers = {"content-type": "application/json"}
    r = httpx.post(f"{server.url}/v1/completions", content=b"{nope", headers=headers, timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_64_streams_with_a_quarter_disconnecting(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str | None, int]:
        leaves = i % 4 == 0
        stream = await client.completions.create(
            model="tiny",
            prompt=f"request {i}: ",
            max_tokens=200 if leaves else 8 + i % 5,
            temperature=0.8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXACT,
        )
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if leaves and len(chunks) == 3:
                await stream.close()  # drops the connection mid-stream
                return None, 0
        return chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    for i, (reason, tokens) in enumerate(results):
        if i % 4:
            assert (reason, tokens) == ("length", 8 + i % 5), i
    deadline = time.monotonic() + 20
    while True:
        m = server.metrics()
        idle = m["ostinato_requests_running"] == m["ostinato_requests_waiting"] == 0
        if idle and m["ostinato_kv_blocks_free"] == m["ostinato_kv_blocks_total"]:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    assert m["ostinato_kv_blocks_used"] == 0
    assert m['ostinato_requests_finished_total{finish_reason="abort"}'] >= 16
    assert m["ostinato_time_to_first_token_seconds_count"] >= 48
    assert m["ostinato_time_per_output_token_seconds_count"] >= 48
    assert m["ostinato_generation_tokens_total"] > 0
    assert 0 <= m["ostinato_prefix_cache_hit_rate"] <= 1
    assert m['ostinato_graph_steps_total{mode="none"}'] > 0  # CPU: every step eager
    assert m["ostinato_graph_padded_tokens_total"] == 0


def _open_stream(client: httpx.Client, prompt: str) -> Iterator[str]:
    """The SSE lines of a streamed completion, once its headers came: it has been queued.

    Dropping the iterator drops the connection, so keep it until the end.
    """
    # Long enough to be running still when the test is done with it (a few ms a token).
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4000, "stream": True} | EXACT
    request = client.build_request("POST", "/v1/completions", json=body)
    return client.send(request, stream=True).iter_lines()


def test_queue_limit_503_then_sigterm_aborts_and_exits_zero(tmp_path):
    config = CONFIG | {"max_num_seqs": 1, "max_model_len": 4096}
    srv = Server([*_flags(config), "--max-waiting-requests", "1"], tmp_path / "server.log")
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            running = _open_stream(client, "first")
            next(running)  # its first token: it runs
            waiting = _open_stream(client, "second")
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": "third"})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "waiting" in r.json()["error"]["message"]
            below = descendants(srv.proc.pid)
            srv.proc.send_signal(signal.SIGTERM)
            for stream in (running, waiting):
                lines = [x for x in stream if x.startswith("data: ")]
                assert lines[-1] == "data: [DONE]"
                assert "shutting down" in json.loads(lines[-2][6:])["error"]["message"]
        assert srv.proc.wait(timeout=20) == 0
    finally:
        srv.stop()
    assert_all_gone(below)


def _engine_process(srv: Server) -> int:
    """The pid of the server's engine-core process."""
    (core,) = child_pids(srv.proc.pid, "spawn_main")
    return core


def test_engine_process_killed_mid_stream_503s_and_exit(tmp_path):
    """SIGKILL the engine-core process while three streams run: each stream ends with an
    error naming it, a new request and /health answer 503, the server exits non-zero by itself
    and no process is left behind."""
    srv = Server(_flags(CONFIG | {"max_model_len": 4096}), tmp_path / "server.log")
    below = descendants(srv.proc.pid)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            streams = [_open_stream(client, f"stream {i}") for i in range(3)]
            for stream in streams:
                next(stream)  # its first token: it runs
            os.kill(_engine_process(srv), signal.SIGKILL)
            for stream in streams:
                lines = [x for x in stream if x.startswith("data: ")]
                assert lines[-1] == "data: [DONE]"
                error = json.loads(lines[-2][6:])["error"]
                assert "engine process was killed by SIGKILL" in error["message"], error
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": "again"})
            assert r.status_code == 503 and "SIGKILL" in r.json()["error"]["message"]
            assert client.get("/health").status_code == 503
        assert srv.proc.wait(timeout=30) == 1, srv.log.read_text()
    finally:
        srv.stop()
    assert_all_gone(below)


def test_a_pipelined_server_answers_as_one_process_and_reports_a_dead_worker(tmp_path, llm):
    """--pipeline-parallel-size 2: the same text as one process; a worker killed between
    requests makes /health and every request answer 503 naming it, then the server exits
    non-zero, with no process left behind."""
    srv = Server([*_flags(CONFIG), "--pipeline-parallel-size", "2"], tmp_path / "server.log")
    below = descendants(srv.proc.pid)
    try:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.0}
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            r = client.post("/v1/completions", json=body | EXACT)
            assert r.json()["choices"][0]["text"] == _greedy(llm, PROMPTS[:1], 8)[0]
            (worker,) = child_pids(_engine_process(srv), "spawn_main")
            os.kill(worker, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while client.get("/health").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            health = client.get("/health")
            assert (health.status_code, health.json()) == (503, {"status": "engine stopped"})
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 503
            assert "stage 1, tensor rank 0 (rank 1) was killed by SIGKILL" in r.text
        assert srv.proc.wait(timeout=30) == 1, srv.log.read_text()
    finally:
        srv.stop()
    assert_all_gone(below)


@pytest.fixture(scope="module")
def spec_client(tmp_path_factory):
    flags = _flags(CONFIG | {"speculative_method": "ngram", "num_speculative_tokens": 3})
    srv = Server(flags, tmp_path_factory.mktemp("spec") / "server.log")
    yield srv, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
    assert srv.stop() == 0, srv.log.read_text()


def test_speculative_server_streams_what_plain_decoding_gives(spec_client, llm):
    """Steps that append several tokens stream them as one chunk: the text, the stop cut and
    the logprobs are those of decoding without drafts; /metrics counts the drafts."""
    server, client = spec_client
    kwargs = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0}
    full = _greedy(llm, PROMPTS[1:2], 24)[0]
    chunks = list(client.completions.create(**kwargs, stream=True, logprobs=1, extra_body=EXACT))
    assert "".join(c.choices[0].text for c in chunks) == full
    per_chunk = [len(c.choices[0].logprobs.tokens) for c in chunks]
    assert sum(per_chunk) == 24 and max(per_chunk) > 1
    stop = full[6:8]
    r = client.completions.create(**kwargs, stop=[stop], extra_body=EXACT)
    assert r.choices[0].text == full[: full.find(stop)]
    m = server.metrics()
    assert m["ostinato_spec_accepted_tokens_total"] > 0
    assert m["ostinato_spec_draft_tokens_total"] >= m["ostinato_spec_accepted_tokens_total"]
    assert 0 < m["ostinato_spec_acceptance_rate"] <= 1
