"""Async front of the synchronous engine.

One thread owns the LLMEngine and runs `step()` while requests are pending; it sleeps on an event
when idle. Everything else reaches the engine through commands that the thread runs between
steps, so engine methods are only ever called from that thread. Outputs go back to the event
loop in one `call_soon_threadsafe` per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ostinato.lora.request import LoRARequest
from ostinato.outputs import RequestOutput
from ostinato.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ostinato.engine.engine import LLMEngine

logger = logging.getLogger(__name__)
T = TypeVar("T")
Prompt = str | list[int]
# Called on the engine thread when a request ends: (finish_reason, ttft seconds, tpot seconds).
FinishObserver = Callable[[str, float | None, float | None], None]


class EngineOverloadedError(RuntimeError):
    """The waiting queue is over its limit; the caller should retry later."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class RequestStream:
    """Outputs of a group of engine requests (the n choices of one API call) in arrival order.

    Iteration ends when every request of the group has finished or been aborted. A consumer
    that falls behind gets each request's latest output once, its new tokens those of every
    step it missed: outputs are cumulative (tokens, text, logprobs), so nothing is lost, and a
    server that cannot send a chunk per token per stream sends fewer, larger chunks instead
    of an ever longer backlog that delays every stream's first token.
    """

    def __init__(self, engine: AsyncEngine, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self._engine = engine
        # outputs not handed out yet, by request; a request's newer output keeps its place
        self._pending: dict[str, RequestOutput] = {}
        self._ready = asyncio.Event()
        self._unfinished = set(request_ids)

    def put(self, out: RequestOutput) -> None:
        """Queue out (on the event loop), merged into the request's output still waiting."""
        waiting = self._pending.get(out.request_id)
        if waiting is not None:  # outputs are made per delivery: this one is ours to change
            out.new_token_ids = waiting.new_token_ids + out.new_token_ids
        self._pending[out.request_id] = out
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        out = self._pending.pop(next(iter(self._pending)))
        if out.finished:
            self._unfinished.discard(out.request_id)
        return out

    def abort(self) -> None:
        """Abort the unfinished requests of the group; a no-op once all have finished."""
        if self._unfinished:
            self._engine.abort(list(self._unfinished))
            self._unfinished.clear()


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one request."""

    stream: RequestStream
    arrival: float
    first_token: float | None = None
    last: RequestOutput | None = None


def latencies(
    arrival: float, first_token: float | None, num_tokens: int, now: float
) -> tuple[float | None, float | None]:
    """A finished request's time to first token and time per output token after it (None
    where it has no such token)."""
    if first_token is None:
        return None, None
    tpot = (now - first_token) / (num_tokens - 1) if num_tokens > 1 else None
    return first_token - arrival, tpot


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_finish: FinishObserver | None = None) -> None:
        self.engine = engine
        self.on_finish = on_finish
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._submit_lock = threading.Lock()
        self._stopped = False  # set under _submit_lock: no command gets in after it
        self._closing = False  # new requests are refused; set when shutdown begins
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- event-loop side -------------------------------------------------------------------

    def start(self) -> None:
        """Bind to the running event loop and start the engine thread."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="ostinato-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self):
        return self.engine.config

    def register_lora(self, adapter: LoRARequest) -> str | None:
        """Check an adapter before the engine thread starts (ValueError naming the problem)."""
        return self.engine.register_lora(adapter)

    async def stats_and_report(self) -> tuple[dict, dict]:
        engine = self.engine
        return await self.call(lambda: (engine.stats(), engine.graph_report()))

    @property
    def is_running(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive() and not self._stopped
        return alive and self.engine.failed is None

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between two steps and return its result."""
        fut: asyncio.Future[T] = self._loop.create_future()

        def run() -> None:
            try:
                self._loop.call_soon_threadsafe(_resolve, fut, fn(), None)
            except Exception as e:
                self._loop.call_soon_threadsafe(_resolve, fut, None, e)

        self._submit(run)
        return await fut

    async def add(
        self,
        requests: list[tuple[Prompt, SamplingParams]],
        request_ids: list[str] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Add a group of requests at once, all through `lora_request`'s adapter (None: the base
        model): all are added, or none and the error is raised.

        Raises ValueError for a bad request, EngineOverloadedError when the waiting queue is full,
        EngineClosedError during shutdown.
        """
        if self._closing:
            raise EngineClosedError("the server is shutting down")
        stream = RequestStream(self, request_ids or [uuid.uuid4().hex for _ in requests])
        arrival = time.monotonic()
        try:
            await self.call(lambda: self._add(requests, stream, arrival, lora_request))
        except asyncio.CancelledError:
            stream.abort()  # the add may still run after we stopped waiting for it
            raise
        return stream

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request; closing or cancelling the iterator aborts it."""
        ids = [request_id] if request_id else None
        stream = await self.add([(prompt, params)], ids, lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests; thread-safe, returns at once. Unknown or finished ids are ignored."""
        # Once closed, the engine thread aborts whatever is left as it stops.
        with contextlib.suppress(EngineClosedError):
            self._submit(lambda: self._abort(request_ids))

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort the ones in flight; their streams end with 'abort'."""
        self._closing = True
        with contextlib.suppress(EngineClosedError):
            self._submit(lambda: self._finish_all("abort", "the server is shutting down"))

    async def shutdown(self) -> None:
        """Abort what runs and stop the engine thread."""
        self._closing = True
        with self._submit_lock:
            self._stopped = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        await asyncio.to_thread(self.engine.shutdown)  # worker processes, if any

    def _submit(self, command: Callable[[], None]) -> None:
        with self._submit_lock:
            if self._stopped:
                raise EngineClosedError("the server is shutting down")
            self._commands.put(command)
        self._wake.set()

    # -- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                self._run_commands()
                if self._stopped:
                    break
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                else:
                    self._wake.wait()
            except Exception as e:
                # Which requests a failed step touched is unknown: fail them all, keep serving.
                logger.exception("engine step failed; failing the requests in flight")
                self._finish_all("error", f"engine error: {type(e).__name__}: {e}")
        self._run_commands()  # those submitted before _stopped was set
        self._finish_all("abort", "the server is shutting down")

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:  # call() routes its own errors; a failed abort must not stop the loop
                logger.exception("engine command failed")

    def _add(
        self,
        requests: list[tuple[Prompt, SamplingParams]],
        stream: RequestStream,
        arrival: float,
        lora_request: LoRARequest | None,
    ) -> None:
        if self.engine.failed is not None:
            raise EngineClosedError(f"the engine has stopped: {self.engine.failed}")
        limit = self.engine.config.max_waiting_requests
        waiting = self.engine.stats()["num_waiting"]
        if waiting + len(requests) > limit:
            raise EngineOverloadedError(
                f"too many requests waiting ({waiting}, limit {limit}); retry later"
            )
        taken = [rid for rid in stream.request_ids if rid in self._tracked]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already running: use a new id")
        added: list[str] = []
        try:
            for rid, (prompt, params) in zip(stream.request_ids, requests, strict=True):
                self.engine.add_request(prompt, params, rid, lora_request=lora_request)
                self._tracked[rid] = _Tracked(stream, arrival)
                added.append(rid)
        except Exception:
            self._abort(added)  # only what this call added: a running id belongs to another stream
            raise

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self._tracked.pop(rid, None) is not None:
                self.engine.abort_request(rid)
                self._observe("abort", None, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        ready = []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue  # aborted after the step was scheduled
            if tracked.first_token is None and out.token_ids:
                tracked.first_token = now
            tracked.last = out
            if out.finished:
                del self._tracked[out.request_id]
                self._observe_finished(tracked, out, now)
            ready.append((tracked.stream, out))
        if ready:
            self._loop.call_soon_threadsafe(_put_all, ready)

    def _observe_finished(self, tracked: _Tracked, out: RequestOutput, now: float) -> None:
        ttft, tpot = latencies(tracked.arrival, tracked.first_token, len(out.token_ids), now)
        self._observe(out.finish_reason or "stop", ttft, tpot)

    def _observe(self, reason: str, ttft: float | None, tpot: float | None) -> None:
        if self.on_finish is not None:
            self.on_finish(reason, ttft, tpot)

    def _finish_all(self, reason: str, message: str) -> None:
        """End every tracked request with `reason`, freeing its engine state."""
        outputs = []
        for rid, tracked in list(self._tracked.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of request %s failed", rid)
            outputs.append(_final_output(rid, tracked.last, reason, message))
        self._deliver(outputs)


def _final_output(rid: str, last: RequestOutput | None, reason: str, message: str) -> RequestOutput:
    if last is None:
        last = RequestOutput(request_id=rid, prompt_token_ids=[], token_ids=[], text="")
    return dataclasses.replace(
        last, new_token_ids=[], finished=True, finish_reason=reason, error=message
    )


def _put_all(ready: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in ready:
        stream.put(out)


def _resolve(fut: asyncio.Future[Any], result: Any, error: Exception | None) -> None:
    if fut.done():  # the caller was cancelled
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)
