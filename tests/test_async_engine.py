"""AsyncEngine and the HTTP layer over a fake engine: the paths a real model cannot trigger."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from ostinato.config import EngineConfig
from ostinato.engine.async_engine import AsyncEngine, EngineClosedError, EngineOverloadedError
from ostinato.outputs import RequestOutput
from ostinato.sampling_params import SamplingParams
from ostinato.server.app import build_app


class ByteTokenizer:
    eos_token_id = 0
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<a>")


class FakeEngine:
    """Emits 'a', 'b', ... one token per step; the first max_num_seqs requests run, the rest wait.

    `fail_step` makes the next step raise; a prompt containing "FAIL" ends with an error output.
    """

    def __init__(self, **config) -> None:
        self.config = EngineConfig(device="cpu", max_model_len=64, **config)
        self.tokenizer = ByteTokenizer()
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.fail_step = False
        self.failed: str | None = None  # set: the engine stopped for good
        self.shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True

    def add_request(
        self, prompt, params: SamplingParams, request_id: str | None = None, lora_request=None
    ) -> str:
        assert lora_request is None  # the async engine passes it through
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if len(ids) > self.config.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens, over max_model_len")
        self.requests[request_id] = (ids, params, [])
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.001)
        if self.fail_step:
            self.fail_step = False
            raise RuntimeError("boom")
        running = list(self.requests.items())[: self.config.max_num_seqs]
        return [self._advance(rid, *req) for rid, req in running]

    def _advance(self, rid: str, ids: list[int], params: SamplingParams, toks: list[int]):
        toks.append(ord("a") + len(toks) % 26)
        failed = b"FAIL" in bytes(ids)
        done = failed or len(toks) >= params.max_tokens
        if done:
            del self.requests[rid]
        reason = ("error" if failed else "length") if done else None
        return RequestOutput(
            rid, ids, list(toks), self.tokenizer.decode(toks), [toks[-1]], done, reason,
            "cannot encode stop string" if failed else None,
        )  # fmt: skip

    def stats(self) -> dict:
        n = len(self.requests)
        running = min(n, self.config.max_num_seqs)
        return {"num_running": running, "num_waiting": n - running, "kv_blocks_total": 8}

    def graph_report(self) -> dict:
        return {}


async def _started(engine: FakeEngine) -> AsyncEngine:
    async_engine = AsyncEngine(engine)
    async_engine.start()
    return async_engine


async def _collect(async_engine: AsyncEngine, prompt: str, max_tokens: int) -> RequestOutput:
    outs = [o async for o in async_engine.generate(prompt, SamplingParams(max_tokens=max_tokens))]
    return outs[-1]


async def _until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_generate_and_step_failure_keeps_loop_alive():
    async def main():
        engine = FakeEngine()
        async_engine = await _started(engine)
        assert (await _collect(async_engine, "hi", 5)).text == "abcde"
        engine.fail_step = True
        failed = await _collect(async_engine, "hi", 5)
        assert failed.finish_reason == "error" and "boom" in failed.error
        assert not engine.requests  # the failed request was aborted in the engine
        assert (await _collect(async_engine, "hi", 3)).text == "abc"
        await async_engine.shutdown()

    asyncio.run(main())


def test_a_stopped_engine_refuses_requests_and_shutdown_stops_its_workers():
    async def main():
        engine = FakeEngine()
        async_engine = await _started(engine)
        engine.failed = "pipeline stage 1 was killed by SIGKILL"
        assert not async_engine.is_running
        with pytest.raises(EngineClosedError, match="killed by SIGKILL"):
            await async_engine.add([("hi", SamplingParams(max_tokens=3))])
        await async_engine.shutdown()
        assert engine.shut_down

    asyncio.run(main())


def test_closing_the_stream_aborts_at_once():
    async def main():
        engine = FakeEngine()
        async_engine = await _started(engine)
        gen = async_engine.generate("hi", SamplingParams(max_tokens=10**6))
        await anext(gen)
        await gen.aclose()
        await _until(lambda: not engine.requests)
        await async_engine.shutdown()

    asyncio.run(main())


def test_waiting_queue_limit_and_shutdown_aborts():
    async def main():
        engine = FakeEngine(max_num_seqs=1, max_waiting_requests=1)
        async_engine = await _started(engine)
        params = SamplingParams(max_tokens=10**6)
        streams = [await async_engine.add([("x", params)]) for _ in range(2)]
        with pytest.raises(EngineOverloadedError):
            await async_engine.add([("x", params)])
        await async_engine.shutdown()
        finals = [[o async for o in s][-1] for s in streams]
        assert {o.finish_reason for o in finals} == {"abort"} and not engine.requests

    asyncio.run(main())


def test_request_error_is_500_and_stream_error_event():
    async def main():
        app = build_app(AsyncEngine(FakeEngine()), ["fake"])
        app.state.async_engine.start()  # ASGITransport runs no lifespan
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = {"model": "fake", "prompt": "FAIL", "max_tokens": 4}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 500 and "stop string" in r.json()["error"]["message"]
            r = await client.post("/v1/completions", json=body | {"stream": True})
            assert '"error"' in r.text and r.text.endswith("data: [DONE]\n\n")
            r = await client.post("/v1/completions", json=body | {"prompt": "ok"})
            assert r.json()["choices"][0]["text"] == "abcd"
        await app.state.async_engine.shutdown()

    asyncio.run(main())


def test_duplicate_request_id_is_refused_and_the_original_runs_on():
    async def main():
        engine = FakeEngine()
        async_engine = await _started(engine)
        first = await async_engine.add([("hi", SamplingParams(max_tokens=20))], ["x"])
        with pytest.raises(ValueError, match="already running"):
            await async_engine.add([("yo", SamplingParams(max_tokens=2))], ["x"])
        outs = [o async for o in first]
        assert outs[-1].finished and outs[-1].text == "abcdefghijklmnopqrst"
        await async_engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 10))
