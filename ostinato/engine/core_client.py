"""The HTTP process's side of the engine-core process (core.py).

EngineCoreClient starts the core (spawn), then speaks to it over two ZeroMQ sockets on
ipc:// paths: it sends token ids and SamplingParams, and turns the per-step token deltas it
gets back into RequestOutputs, with the text (incremental detokenisation and stop strings)
made here. It has AsyncEngine's interface, so the server takes either.

A core that dies (killed, a failed step, a lost worker) ends every request in flight with
finish_reason "abort" and the reason; later requests raise EngineClosedError; `on_dead` tells
the server, which then exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from ostinato.config import EngineConfig
from ostinato.engine import messages as m
from ostinato.engine.async_engine import (
    EngineClosedError,
    EngineOverloadedError,
    FinishObserver,
    Prompt,
    RequestStream,
    latencies,
)
from ostinato.engine.core import core_main
from ostinato.engine.detokenizer import IncrementalDetokenizer, cut_at_stop
from ostinato.engine.engine import prompt_token_ids
from ostinato.loader import load_hf_config
from ostinato.lora.request import LoRARequest
from ostinato.outputs import RequestOutput
from ostinato.sampling_params import SamplingParams
from ostinato.tokenizer import load_tokenizer

logger = logging.getLogger("ostinato")

STOP_PATIENCE = 30.0  # seconds the core gets to stop its workers and exit after a Shutdown


@dataclass
class _Request:
    """One request of the core, as this process sees it."""

    stream: RequestStream
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    arrival: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    first_token: float | None = None
    last: RequestOutput | None = None


class EngineCoreClient:
    def __init__(
        self,
        config: EngineConfig,
        adapters: Sequence[LoRARequest] = (),
        core: Callable[..., Any] = core_main,
    ) -> None:
        """Start the core and wait until it has loaded the model (ValueError for a bad
        adapter or config, RuntimeError when it fails otherwise). `core` is the process's
        entry point, core_main's signature (benchmarks/serve_path.py passes a scripted one)."""
        self.config = config.for_model(load_hf_config(config.model))
        self.tokenizer = load_tokenizer(config.model)
        self.adapters = {a.name: a for a in adapters}
        self.on_finish: FinishObserver | None = None
        self.on_dead: Callable[[str], None] | None = None
        self.dead: str | None = None  # why the core stopped, once it did
        self._closing = False
        self._requests: dict[str, _Request] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._encode = m.encoder().encode
        self._decode = m.output_decoder().decode
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task | None = None
        self._dir = tempfile.mkdtemp(prefix="ostinato-core-")
        self._context = zmq.asyncio.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.SNDHWM, 0)  # sends never block the event loop
        self._input.bind(f"ipc://{self._dir}/input")
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(f"ipc://{self._dir}/output")
        self.proc = mp.get_context("spawn").Process(
            target=core,
            args=(config, list(adapters), f"ipc://{self._dir}/input",
                  f"ipc://{self._dir}/output", os.getpid()),
            name="ostinato-engine-core",
        )  # fmt: skip
        self.proc.start()
        try:
            self.num_blocks = self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> int:
        """The core's Ready (its KV block count), or why it failed. Loading and capture take
        as long as they take; a core that dies meanwhile is seen within 0.1 s."""
        sync = zmq.Socket.shadow(self._output.underlying)
        while not sync.poll(100):
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine process {_exit_words(self.proc.exitcode)}")
        msg = self._decode(sync.recv())
        if isinstance(msg, m.Dead):
            error = ValueError if msg.error_kind == "invalid" else RuntimeError
            raise error(f"the engine failed to start: {msg.reason}")
        return msg.num_blocks

    # -- the server's interface (AsyncEngine's) ---------------------------------------------

    def start(self) -> None:
        """Bind to the running event loop: read the core's outputs, watch the process."""
        self._loop = asyncio.get_running_loop()
        self._reader = self._loop.create_task(self._read())
        self._loop.add_reader(self.proc.sentinel, self._exited)

    @property
    def is_running(self) -> bool:
        return self.dead is None and not self._closing and self.proc.is_alive()

    def register_lora(self, adapter: LoRARequest) -> str:
        if self.adapters.get(adapter.name) != adapter:
            raise ValueError(f"LoRA adapter {adapter.name!r} was not given to the engine process")
        return adapter.name

    async def add(
        self,
        requests: list[tuple[Prompt, SamplingParams]],
        request_ids: list[str] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """As AsyncEngine.add: prompts are tokenised here, the core checks and queues them."""
        self._check_open()
        ids = request_ids or [uuid.uuid4().hex for _ in requests]
        if len(set(ids)) < len(ids) or any(i in self._requests for i in ids):
            raise ValueError("request id is already running: use a new id")
        stream = RequestStream(self, ids)
        arrival = time.monotonic()
        news = []
        for rid, (prompt, params) in zip(ids, requests, strict=True):
            token_ids = prompt_token_ids(self.tokenizer, prompt)
            news.append(m.NewRequest(rid, token_ids, params))
        for new in news:
            detok = IncrementalDetokenizer(self.tokenizer)
            logprobs = [] if new.params.logprobs is not None else None
            self._requests[new.request_id] = _Request(
                stream, new.prompt_token_ids, new.params, detok, arrival, logprobs=logprobs
            )
        try:
            await self._call(lambda call_id: m.Add(call_id, news, lora_request))
        except asyncio.CancelledError:
            stream.abort()  # the add may still happen after we stopped waiting for it
            raise
        except BaseException:
            for rid in ids:
                self._requests.pop(rid, None)
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests here and in the core (which frees their KV blocks); returns at once."""
        gone = [rid for rid in request_ids if self._requests.pop(rid, None) is not None]
        for _ in gone:
            self._observe("abort", None, None)
        if gone and self.dead is None:
            self._send(m.Abort(gone))

    async def stats_and_report(self) -> tuple[dict, dict]:
        report = await self._call(m.Query)
        return report["stats"], report["graph_report"]

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort the ones in flight; their streams end with 'abort'."""
        self._closing = True
        ids = list(self._requests)
        self._finish_all("the server is shutting down")
        if ids and self.dead is None:
            self._send(m.Abort(ids))

    async def shutdown(self) -> None:
        """Abort what runs, stop the core (and its workers) and wait for it."""
        self.begin_shutdown()
        if self._loop is not None:
            self._loop.remove_reader(self.proc.sentinel)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop the core now (Shutdown, then SIGTERM, then SIGKILL) and free the sockets;
        safe to call more than once and from outside the event loop."""
        self._closing = True
        if self.proc.is_alive():
            # never blocking: a core that is dying has no peer socket to take the message
            with contextlib.suppress(zmq.ZMQError):
                shutdown = self._encode(m.Shutdown())
                zmq.Socket.shadow(self._input.underlying).send(shutdown, flags=zmq.NOBLOCK)
            self.proc.join(STOP_PATIENCE)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.is_alive():
                os.kill(self.proc.pid, sig)
                self.proc.join(5.0)
        if not self._context.closed:
            self._context.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- the core's outputs -----------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            frame = await self._output.recv(copy=False)
            try:
                self._handle(self._decode(frame.buffer))
            except Exception:  # a bad message must not stop the reader
                logger.exception("engine output not handled")

    def _handle(self, msg: m.Output) -> None:
        if isinstance(msg, m.Step):
            now = time.monotonic()
            ready = [r for d in msg.outputs if (r := self._apply(d, now)) is not None]
            for stream, out in ready:
                stream.put(out)
        elif isinstance(msg, m.Reply):
            fut = self._calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                if msg.error is None:
                    fut.set_result(msg.result)
                else:
                    fut.set_exception(_error(msg))
        elif isinstance(msg, m.Dead):
            self._die(f"the engine process has stopped: {msg.reason}")

    def _apply(self, delta: m.Delta, now: float) -> tuple[RequestStream, RequestOutput] | None:
        """Append a step's tokens one at a time, detokenising, and stop at a stop string (the
        core then aborts the request: it does not see text)."""
        req = self._requests.get(delta.request_id)
        if req is None:
            return None  # aborted here after the core ran its step
        reason = delta.finish_reason
        if delta.prompt_logprobs is not None:
            req.prompt_logprobs = delta.prompt_logprobs
        kept: list[int] = []
        for i, token in enumerate(delta.new_token_ids):
            req.token_ids.append(token)
            kept.append(token)
            if req.logprobs is not None and delta.logprobs is not None:
                req.logprobs.append(delta.logprobs[i])
            req.detok.update(req.token_ids)
            if len(req.token_ids) >= req.params.min_tokens and cut_at_stop(
                req.detok, req.params.stop
            ):
                if reason is None:
                    self._send(m.Abort([delta.request_id]))
                reason = "stop"
                break
        if reason is not None and not req.detok.text_stopped:
            req.detok.update(req.token_ids, final=True)
        if req.first_token is None and req.token_ids:
            req.first_token = now
        out = RequestOutput(
            request_id=delta.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.token_ids),
            text=req.detok.text,
            new_token_ids=kept,
            finished=reason is not None,
            finish_reason=reason,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            prompt_logprobs=req.prompt_logprobs,
            num_cached_tokens=delta.num_cached_tokens,
        )
        req.last = out
        if reason is not None:
            del self._requests[delta.request_id]
            self._observe_finished(req, out, now)
        return req.stream, out

    def _observe_finished(self, req: _Request, out: RequestOutput, now: float) -> None:
        ttft, tpot = latencies(req.arrival, req.first_token, len(out.token_ids), now)
        self._observe(out.finish_reason or "stop", ttft, tpot)

    def _observe(self, reason: str, ttft: float | None, tpot: float | None) -> None:
        if self.on_finish is not None:
            self.on_finish(reason, ttft, tpot)

    # -- failures ---------------------------------------------------------------------------

    def _exited(self) -> None:
        """The core process ended (its sentinel became readable)."""
        self._loop.remove_reader(self.proc.sentinel)
        self.proc.join(1.0)
        self._die(f"the engine process {_exit_words(self.proc.exitcode)}")

    def _die(self, reason: str) -> None:
        if self.dead is not None or self._closing:
            return
        self.dead = reason
        logger.error("%s", reason)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineClosedError(reason))
        self._calls.clear()
        self._finish_all(reason)
        if self.on_dead is not None:
            self.on_dead(reason)

    def _finish_all(self, message: str) -> None:
        """End every request with finish_reason 'abort' and `message` (a 503 for clients)."""
        for rid, req in list(self._requests.items()):
            last = req.last or RequestOutput(rid, req.prompt_token_ids, [], "")
            out = RequestOutput(
                rid, last.prompt_token_ids, last.token_ids, last.text, [], True, "abort",
                message, last.logprobs, last.num_cached_tokens,
            )  # fmt: skip
            req.stream.put(out)
            self._observe("abort", None, None)
        self._requests.clear()

    def _check_open(self) -> None:
        if self.dead is not None:
            raise EngineClosedError(self.dead)
        if self._closing:
            raise EngineClosedError("the server is shutting down")

    # -- sending ----------------------------------------------------------------------------

    async def _call(self, message: Callable[[int], m.Input]):
        self._check_open()
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self._calls[call_id] = fut
        self._send(message(call_id))
        try:
            return await fut
        finally:
            self._calls.pop(call_id, None)

    def _send(self, msg: m.Input) -> None:
        # A PUSH to a connected peer with no high-water mark does not block.
        self._input.send(self._encode(msg), copy=False)


def _error(reply: m.Reply) -> Exception:
    kinds = {
        "invalid": ValueError,
        "overloaded": EngineOverloadedError,
        "closed": EngineClosedError,
    }
    return kinds.get(reply.error_kind, RuntimeError)(reply.error)


def _exit_words(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
