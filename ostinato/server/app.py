"""The OpenAI-compatible HTTP API over an engine client: the engine-core process's
(EngineCoreClient, what `ostinato serve` runs) or an in-process AsyncEngine."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from ostinato.engine.async_engine import (
    AsyncEngine,
    EngineClosedError,
    EngineOverloadedError,
    Prompt,
    RequestStream,
)
from ostinato.lora.request import LoRARequest
from ostinato.outputs import RequestOutput
from ostinato.sampling_params import SamplingParams, StructuredOutputsParams
from ostinato.server import protocol
from ostinato.server.metrics import CONTENT_TYPE, ServerMetrics
from ostinato.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_value,
    error_body,
)
from ostinato.server.tools import TOOL_PARSERS, ToolParser

if TYPE_CHECKING:
    from ostinato.engine.core_client import EngineCoreClient

    EngineClient = AsyncEngine | EngineCoreClient

RETRY_AFTER_SECONDS = 1
FAILED = ("error", "abort")  # finish reasons that end a call with an error, not a choice


@dataclass
class _Call:
    """One API call being answered: its engine requests and the shape of its choices."""

    id: str
    model: str
    chat: bool
    n: int  # choices per prompt
    request_ids: list[str]
    num_logprobs: int | None
    stops: list[str]
    decode: Any  # tokenizer.decode, for logprob token strings
    tools: ToolParser | None = None  # chat with tools: replies are parsed for tool calls
    echo: list[str] | None = None  # completions' echo: each prompt's text
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: top-N per prompt token
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.index = {rid: i for i, rid in enumerate(self.request_ids)}
        self._started: set[int] = set()  # choices that sent their first chunk
        # per choice: characters of the tokens whose logprobs were sent, where the next start
        self._token_chars = [0] * len(self.request_ids)

    def choice(
        self,
        i: int,
        text: str,
        out: RequestOutput,
        start: int,
        finish: str | None,
        delta: bool,
        text_offset: int = 0,
    ) -> dict[str, Any]:
        """Choice i: `text` starts at text_offset of out.text; out's tokens from `start` on
        are new. (A stream may hold back text that could begin a stop string, so the offset
        is where the client's text ends, not len(out.text) - len(text); the new tokens'
        logprobs count from the characters of the tokens before them, as a whole reply's do.)"""
        first = i not in self._started
        self._started.add(i)
        echo = self.echo[i // self.n] if self.echo is not None else ""
        if self.chat:
            body = {"delta": {"content": text}} if delta else {"message": _message(text)}
        else:
            body = {"text": echo + text if first else text}
        if self.tools is not None and out.finished:
            calls = self._tool_calls(out.text, text_offset, delta)
            if calls is not None:
                body, finish = calls, "tool_calls" if finish == "stop" else finish
        logprobs = self._logprobs(i, out, start, len(echo))
        if first and echo and logprobs is not None:  # the prompt's tokens come first
            ids, lps = out.prompt_token_ids, out.prompt_logprobs
            echoed = protocol.completion_logprobs(self.decode, ids, lps, self.num_logprobs, 0)
            logprobs = protocol.join_logprobs(echoed, logprobs)
        choice = {"index": i, **body, "logprobs": logprobs, "finish_reason": finish}
        if first and self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_scores(out)
        return choice

    def prompt_scores(self, out: RequestOutput) -> list | None:
        if self.prompt_logprobs is None:
            return None
        ids, lps = out.prompt_token_ids, out.prompt_logprobs
        return protocol.prompt_logprobs(self.decode, ids, lps, self.prompt_logprobs)

    def _tool_calls(self, text: str, offset: int, delta: bool) -> dict | None:
        """The message (or a stream's last delta, after `offset` characters were sent) of a
        reply that calls tools; None when it calls none."""
        content, calls = self.tools.parse(text)
        if not calls:
            return None
        if delta:
            rest = content[offset:]
            entries = [c.openai(k) for k, c in enumerate(calls)]
            return {"delta": ({"content": rest} if rest.strip() else {}) | {"tool_calls": entries}}
        message = _message(content.strip() or None) | {"tool_calls": [c.openai() for c in calls]}
        return {"message": message}

    def _logprobs(self, i: int, out: RequestOutput, start: int, echoed: int) -> dict | None:
        """Choice i's logprobs of out's tokens from `start` on; `echoed`: characters of the
        prompt before the reply."""
        if self.num_logprobs is None or out.logprobs is None:
            return None
        ids, lps = out.token_ids[start:], out.logprobs[start:]
        if self.chat:
            return protocol.chat_logprobs(self.decode, ids, lps, self.num_logprobs)
        offset = echoed + self._token_chars[i]
        logprobs = protocol.completion_logprobs(self.decode, ids, lps, self.num_logprobs, offset)
        self._token_chars[i] += sum(len(token) for token in logprobs["tokens"])
        return logprobs

    def envelope(self, choices: list[dict], delta: bool, usage: dict | None = None) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        obj = f"{kind}.chunk" if delta and self.chat else kind
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        return body | {"choices": choices, "usage": usage}

    def usage(self, finals: list[RequestOutput]) -> dict[str, int]:
        """Prompt tokens count once per prompt, not once per choice."""
        prompt = sum(len(o.prompt_token_ids) for o in finals[:: self.n])
        return protocol.usage(prompt, sum(len(o.token_ids) for o in finals))


class _EventStream(StreamingResponse):
    """Closes its generator however the response ends, so a disconnect aborts at once."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _check_fields(body: protocol.GenerationRequest) -> None:
    error = body.unsupported_field()
    if error is not None:
        raise error


def _message(text: str | None) -> dict[str, str | None]:
    return {"role": "assistant", "content": text}


def _without_stop_prefix(text: str, stops: list[str]) -> str:
    """text less any ending that begins a stop string: the engine cuts it if the stop completes."""
    cut = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - cut]


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _failure(out: RequestOutput) -> APIError:
    if out.finish_reason == "abort":
        return APIError(503, out.error or "request aborted", None, "server_error", "aborted")
    return APIError(500, out.error or "request failed", None, "server_error", "request_failed")


class OpenAIServer:
    """Endpoint handlers; one instance per app."""

    def __init__(
        self,
        engine: EngineClient,
        served_model_names: list[str],
        adapters: Sequence[LoRARequest] = (),
        tool_call_parser: str | None = None,
    ) -> None:
        """adapters: LoRA adapters clients name as `model`; each is checked here (ValueError).
        tool_call_parser: the format of the model's tool calls (a TOOL_PARSERS name)."""
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"unknown tool call parser {tool_call_parser!r}: choose {', '.join(TOOL_PARSERS)}"
            )
        self.tool_parser = TOOL_PARSERS[tool_call_parser]() if tool_call_parser else None
        self.metrics = ServerMetrics()
        self.engine = engine
        engine.on_finish = self.metrics.observe_finish
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len
        self.model_names = served_model_names
        self.adapters: dict[str, LoRARequest] = {}
        for adapter in adapters:
            if adapter.name in self.model_names or adapter.name in self.adapters:
                raise ValueError(
                    f"LoRA module name {adapter.name!r} is taken: names of served models and "
                    "adapters must all differ"
                )
            engine.register_lora(adapter)
            self.adapters[adapter.name] = adapter

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        _check_fields(body)
        lora = self._check_model(body.model)
        requests = []
        constraint = body.constraint()
        prompts = body.prompts()
        for prompt in prompts:
            max_tokens = self._room(prompt) if body.max_tokens is None else body.max_tokens
            requests += self._choices(
                body, prompt, max_tokens, body.logprobs, body.prompt_logprobs_needed(), constraint
            )
        echo = None
        if body.echo:
            echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts]
        return await self._answer(
            raw, body, requests, False, body.logprobs, "prompt", lora, echo=echo
        )

    async def chat_completions(self, body: ChatCompletionRequest, raw: Request) -> Response:
        _check_fields(body)
        lora = self._check_model(body.model)
        tools, constraint = body.tool_dicts(), body.constraint()
        parser = self._tool_parser() if tools else None
        forced = body.forced_tools(tools) if tools else None
        if forced is not None:
            if constraint is not None:
                message = "a forced tool_choice cannot be combined with a response format"
                raise APIError(400, message, "tool_choice")
            many = body.tool_choice == "required" and body.parallel_tool_calls
            constraint = parser.constraint(forced, many)
        try:
            prompt = self.tokenizer.apply_chat_template(body.chat(), tools=tools)
        except ValueError as e:
            raise bad_value(e, "messages") from e
        limits = (body.max_completion_tokens, body.max_tokens)
        max_tokens = next((m for m in limits if m is not None), None)
        if max_tokens is None:
            max_tokens = self._room(prompt)
        requests = self._choices(
            body, prompt, max_tokens, body.num_logprobs(), body.prompt_logprobs, constraint
        )
        num_logprobs = body.num_logprobs()
        return await self._answer(raw, body, requests, True, num_logprobs, "messages", lora, parser)

    def _tool_parser(self) -> ToolParser:
        if self.tool_parser is None:
            message = (
                "tools need a tool call parser: start the server with --tool-call-parser "
                f"({' or '.join(TOOL_PARSERS)}, the format of the model's calls)"
            )
            raise APIError(400, message, "tools")
        return self.tool_parser

    async def models(self) -> dict:
        """The base model's names, then each LoRA adapter (its parent: the first name)."""
        created = int(time.time())
        card = {"object": "model", "created": created, "owned_by": "ostinato"}
        card |= {"max_model_len": self.max_model_len}
        cards = [card | {"id": name} for name in self.model_names]
        parent = self.model_names[0]
        cards += [
            card | {"id": name, "parent": parent, "root": adapter.path}
            for name, adapter in self.adapters.items()
        ]
        return {"object": "list", "data": cards}

    async def health(self) -> Response:
        if not self.engine.is_running:
            return JSONResponse({"status": "engine stopped"}, 503)
        return JSONResponse({"status": "ok"})

    async def prometheus(self) -> Response:
        stats, report = await self.engine.stats_and_report()
        return Response(self.metrics.render(stats, report), media_type=CONTENT_TYPE)

    def _check_model(self, model: str) -> LoRARequest | None:
        """The adapter `model` names, None for the base model; 404 for anything else."""
        if model in self.model_names:
            return None
        if model in self.adapters:
            return self.adapters[model]
        names = self.model_names + list(self.adapters)
        message = f"The model `{model}` does not exist; this server has {names}"
        raise APIError(404, message, "model", code="model_not_found")

    def _room(self, prompt: Prompt) -> int:
        """max_tokens when the client gives none: whatever the context has left."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return max(self.max_model_len - len(ids), 1)

    @staticmethod
    def _choices(
        body: protocol.GenerationRequest,
        prompt: Prompt,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        constraint: StructuredOutputsParams | None,
    ) -> list[tuple[Prompt, SamplingParams]]:
        try:
            return [
                (prompt, body.sampling_params(max_tokens, logprobs, j, prompt_logprobs, constraint))
                for j in range(body.n)
            ]
        except ValueError as e:
            raise bad_value(e, "prompt") from e

    async def _answer(
        self,
        raw: Request,
        body: protocol.GenerationRequest,
        requests: list[tuple[Prompt, SamplingParams]],
        chat: bool,
        num_logprobs: int | None,
        param: str,
        lora: LoRARequest | None,
        tools: ToolParser | None = None,
        echo: list[str] | None = None,
    ) -> Response:
        prefix = "chatcmpl" if chat else "cmpl"
        call_id = f"{prefix}-{uuid.uuid4().hex}"
        ids = [f"{call_id}-{i}" for i in range(len(requests))]
        stops = requests[0][1].stop
        decode = self.tokenizer.decode
        call = _Call(
            call_id, body.model, chat, body.n, ids, num_logprobs, stops, decode,
            tools=tools, echo=echo, prompt_logprobs=body.prompt_logprobs,
        )  # fmt: skip
        stream = await self._add(requests, ids, param, lora, body.constraint_field)
        if body.stream:
            events = self._events(call, stream, body.include_usage)
            return _EventStream(events, media_type="text/event-stream")
        finals = await _finals(stream, raw)
        outs = [finals[rid] for rid in ids]
        failed = next((o for o in outs if o.finish_reason in FAILED), None)
        if failed is not None:
            raise _failure(failed)
        choices = [call.choice(i, o.text, o, 0, o.finish_reason, False) for i, o in enumerate(outs)]
        response = call.envelope(choices, False, call.usage(outs))
        if chat and body.prompt_logprobs is not None:  # vLLM puts chat's beside the choices
            response["prompt_logprobs"] = choices[0].pop("prompt_logprobs")
            for choice in choices[1:]:
                del choice["prompt_logprobs"]
        return JSONResponse(response)

    async def _add(
        self,
        requests: list[tuple[Prompt, SamplingParams]],
        ids: list[str],
        param: str,
        lora: LoRARequest | None,
        constraint_field: str,
    ) -> RequestStream:
        try:
            return await self.engine.add(requests, ids, lora)
        except ValueError as e:
            message = str(e)
            if not message.startswith("structured_outputs"):
                raise bad_value(e, param) from e
            if constraint_field != "structured_outputs":  # name the field the grammar came from
                message = constraint_field + ":" + message.partition(":")[2]
            raise APIError(400, message, constraint_field.partition(".")[0]) from e

    async def _events(
        self, call: _Call, stream: RequestStream, include_usage: bool
    ) -> AsyncIterator[str]:
        """SSE chunks; a disconnect cancels this generator, and `finally` aborts the requests."""
        sent_text = [0] * len(call.request_ids)
        sent_tokens = [0] * len(call.request_ids)
        finals: list[RequestOutput | None] = [None] * len(call.request_ids)
        try:
            if call.chat:
                roles = [{"index": i, "delta": _message("")} for i in range(len(finals))]
                yield _sse(call.envelope(roles, True))
            async for out in stream:
                if out.finish_reason in FAILED:
                    yield _sse(_failure(out).body())
                    break
                i = call.index[out.request_id]
                visible = out.text if out.finished else _without_stop_prefix(out.text, call.stops)
                if call.tools is not None and not out.finished:  # a tool call is sent whole
                    visible = visible[: call.tools.held_from(visible)]
                offset, start = sent_text[i], sent_tokens[i]
                text = visible[offset:]
                sent_text[i], sent_tokens[i] = len(visible), len(out.token_ids)
                if out.finished:
                    finals[i] = out
                if text or out.finished or (call.num_logprobs is not None and out.new_token_ids):
                    choice = call.choice(i, text, out, start, out.finish_reason, True, offset)
                    yield _sse(call.envelope([choice], True))
            else:
                if include_usage:
                    yield _sse(call.envelope([], True, call.usage(finals)))
        finally:
            stream.abort()
        yield "data: [DONE]\n\n"


async def _finals(stream: RequestStream, raw: Request) -> dict[str, RequestOutput]:
    """Wait for every request of the stream to end; abort them if the client leaves first."""

    async def drain() -> dict[str, RequestOutput]:
        return {out.request_id: out async for out in stream if out.finished}

    collect = asyncio.ensure_future(drain())
    gone = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        left = not collect.done()
        if left:
            collect.cancel()
            stream.abort()
    if left:
        raise APIError(499, "client closed the request", code="client_closed")
    return collect.result()


async def _disconnected(raw: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0]
    loc = [str(x) for x in err["loc"][1:]]  # loc[0] is "body"
    if err["type"] == "json_invalid":
        message, param = f"invalid JSON body: {err['msg']}", None
    else:
        message, param = f"{'.'.join(loc) or 'request body'}: {err['msg']}", (loc or [None])[0]
    return JSONResponse(error_body(message, "invalid_request_error", param, None), 400)


def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
    body = error_body(str(exc.detail), "invalid_request_error", None, None)
    return JSONResponse(body, exc.status_code, headers=exc.headers)


def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), exc.status, headers=exc.headers)


def _overloaded(_: Request, exc: EngineOverloadedError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
    return _api_error(_, APIError(503, str(exc), None, "server_error", "queue_full", headers))


def _closed(_: Request, exc: EngineClosedError) -> JSONResponse:
    return _api_error(_, APIError(503, str(exc), None, "server_error", "shutting_down"))


def build_app(
    engine: EngineClient,
    served_model_names: list[str],
    adapters: Sequence[LoRARequest] = (),
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The app over an engine client; its lifespan starts and stops it
    (app.state.async_engine). `adapters`: LoRA adapters clients pick by name as `model`,
    checked here (ValueError). `tool_call_parser`: the format of the model's tool calls
    (server/tools.py)."""
    server = OpenAIServer(engine, served_model_names, adapters, tool_call_parser)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.engine.start()
        yield
        await server.engine.shutdown()

    app = FastAPI(title="ostinato", lifespan=lifespan)
    app.state.async_engine = server.engine
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    app.get("/v1/models")(server.models)
    app.get("/health")(server.health)
    app.get("/metrics")(server.prometheus)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(EngineOverloadedError, _overloaded)
    app.add_exception_handler(EngineClosedError, _closed)
    return app
