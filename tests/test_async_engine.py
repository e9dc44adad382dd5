"""AsyncEngine and the HTTP layer over a fake engine: the paths a real model cannot trigger."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from helpers import FakeEngine

from ostinato.engine.async_engine import (
    AsyncEngine,
    EngineClosedError,
    EngineOverloadedError,
    RequestStream,
)
from ostinato.outputs import RequestOutput
from ostinato.sampling_params import SamplingParams
from ostinato.server.app import build_app


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


def _out(rid: str, tokens: list[int], finished: bool = False) -> RequestOutput:
    text = "".join(chr(96 + t) for t in tokens)
    reason = "length" if finished else None
    return RequestOutput(rid, [], tokens, text, tokens[-1:], finished, reason)


def test_a_stream_that_falls_behind_gets_each_requests_latest_output_once():
    """A server stream that cannot send a chunk per step gets one output per request with
    every token since its last read: no backlog to work through before a newer token."""

    async def main():
        stream = RequestStream(None, ["a", "b"])
        for out in (_out("a", [1]), _out("b", [7]), _out("a", [1, 2]), _out("a", [1, 2, 3])):
            stream.put(out)
        first, second = await anext(stream), await anext(stream)
        assert (first.request_id, first.token_ids, first.text) == ("a", [1, 2, 3], "abc")
        assert first.new_token_ids == [1, 2, 3]  # every step's new tokens since the last read
        assert (second.request_id, second.new_token_ids) == ("b", [7])  # a kept its place
        stream.put(_out("a", [1, 2, 3, 4], finished=True))
        stream.put(_out("b", [7, 8]))
        stream.put(_out("b", [7, 8, 9], finished=True))
        rest = [out async for out in stream]
        assert [(o.request_id, o.new_token_ids, o.finished) for o in rest] == [
            ("a", [4], True),
            ("b", [8, 9], True),
        ]

    asyncio.run(main())


def test_a_stream_waits_for_the_next_output():
    async def main():
        stream = RequestStream(None, ["a"])
        reader = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.01)
        assert not reader.done()
        stream.put(_out("a", [5], finished=True))
        assert (await reader).token_ids == [5]
        with pytest.raises(StopAsyncIteration):
            await anext(stream)

    asyncio.run(main())
