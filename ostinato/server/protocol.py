"""OpenAI request bodies and the JSON shapes of responses, chunks and errors."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ostinato.sampling_params import SamplingParams, StructuredOutputsParams

# Request fields a SamplingParams or engine error can name; its messages begin with the field's
# name (longest first: "stop_token_ids ..." names stop_token_ids, not stop).
SAMPLING_FIELDS = tuple(
    sorted(
        ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
         "logprobs", "prompt_logprobs", "stop", "stop_token_ids", "presence_penalty",
         "frequency_penalty", "repetition_penalty", "logit_bias", "structured_outputs"),
        key=len,
        reverse=True,
    )
)  # fmt: skip

# Fields OpenAI's API accepts without changing what it generates, ignored here as there (value
# -> whether ignoring it is true to what the client asked). Every other field a request model
# does not declare is a 400 naming it (see unsupported_field).
IGNORED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "user": lambda _: True,  # an end-user id for abuse monitoring
    "safety_identifier": lambda _: True,  # the same, its newer name
    "prompt_cache_key": lambda _: True,  # a routing hint for OpenAI's prompt cache
    "service_tier": lambda _: True,  # OpenAI's processing tier
    "metadata": lambda _: True,  # tags for stored completions
    "store": lambda v: not v,  # nothing is stored here: store=true is refused
}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type_, code, headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_value(error: ValueError, default_param: str) -> APIError:
    """A 400 for a ValueError from SamplingParams or the engine, naming the field at fault."""
    message = str(error)
    param = next((f for f in SAMPLING_FIELDS if message.startswith(f)), default_param)
    if param not in message:
        message = f"{param}: {message}"
    return APIError(400, message, param)


class StreamOptions(BaseModel):
    include_usage: bool = False


class Strict(BaseModel):
    """A request object whose unknown fields are a 400 (not silently ignored)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JSONSchemaFormat(Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs` extension (extra_body with the openai client)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=self.json_,
            json_object=bool(self.json_object),
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
        )


class GenerationRequest(BaseModel):
    """The fields chat and completions share. Undeclared fields are kept (extra="allow") so
    that unsupported_field can name them in a 400; none is ever silently dropped, except the
    IGNORED_FIELDS OpenAI ignores too."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1, le=128)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id (a string in JSON) -> bias
    response_format: ResponseFormat | None = None
    # vLLM's extensions (extra_body with the openai client)
    structured_outputs: StructuredOutputs | None = None
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False  # generate exactly max_tokens tokens
    prompt_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def constraint(self) -> StructuredOutputsParams | None:
        """What response_format or structured_outputs asks the output to match."""
        fmt, extension = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text" and extension is not None:
            raise APIError(
                400, "give response_format or structured_outputs, not both", "response_format"
            )
        if extension is not None:
            try:
                return extension.params()
            except ValueError as e:
                raise bad_value(e, "structured_outputs") from e
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None:
            message = "response_format.json_schema is required when type is json_schema"
            raise APIError(400, message, "response_format")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)

    @property
    def constraint_field(self) -> str:
        """The request field that an error of the constraint names."""
        if self.structured_outputs is not None:
            return "structured_outputs"
        return "response_format.json_schema.schema" if self.response_format else "tools"

    def unsupported_field(self) -> APIError | None:
        """A 400 naming the first field this server does not know (IGNORED_FIELDS aside)."""
        for name, value in (self.model_extra or {}).items():
            ignored = IGNORED_FIELDS.get(name)
            if ignored is None or not ignored(value):
                message = (
                    f"{name}: this server does not support the field {name!r} (with this "
                    "value); remove it (see the README's list of supported fields)"
                )
                return APIError(400, message, name)
        return None

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        choice: int,
        prompt_logprobs: int | None = None,
        constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """Parameters of the choice-th of n samples; raises ValueError naming a bad field."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            # Each choice needs its own seed, or n seeded samples would all be the same.
            seed=None if self.seed is None else self.seed + choice,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=dict(self.logit_bias or {}),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=constraint,
        )


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # the prompt before the completion (with logprobs: its tokens' too)
    best_of: int | None = None  # only best_of == n (nothing to choose from) is supported

    def unsupported_field(self) -> APIError | None:
        if self.best_of is not None and self.best_of != self.n:
            message = (
                f"best_of: only best_of equal to n ({self.n}) is supported, got {self.best_of}; "
                "leave it out and ask for n completions"
            )
            return APIError(400, message, "best_of")
        return super().unsupported_field()

    def prompt_logprobs_needed(self) -> int | None:
        """Prompt logprobs the engine computes: for prompt_logprobs, and for echo's logprobs."""
        asked = [
            n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None
        ]
        return max(asked, default=None)

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a text, a token list, or a list of either."""
        p = self.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts or any(len(x) == 0 for x in prompts):
            raise APIError(400, "prompt must not be empty", "prompt")
        return prompts


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (tool call arguments as objects)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls is not None:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        return out

    def text(self) -> str:
        """The content as text; parts other than text are refused."""
        if not isinstance(self.content, list):
            return self.content or ""
        if any(part.get("type") != "text" for part in self.content):
            raise APIError(400, "messages: only text content parts are supported", "messages")
        return "".join(part.get("text", "") for part in self.content)


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):  # text that is not JSON stays text
        with contextlib.suppress(json.JSONDecodeError):
            fn["arguments"] = json.loads(fn["arguments"])
    return {**call, "function": fn}


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls always follow the parameters schema


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools the model is shown (none with tool_choice "none"), as templates read them."""
        if self.tool_choice is not None and not self.tools:
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def forced_tools(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """The tools a call must be made to (tool_choice required or a named function)."""
        if self.tool_choice == "required":
            return tools
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        name = self.tool_choice.function.name
        named = [t for t in tools if t["function"]["name"] == name]
        if not named:
            raise APIError(400, f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        return named


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _top(logprobs: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(logprobs.items(), key=lambda kv: -kv[1])[:n]


def completion_logprobs(
    decode,
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, float] | None],
    n: int,
    offset: int,
) -> dict[str, list]:
    """The completions `logprobs` object; offsets count characters from `offset`. An entry
    of None (the first prompt token's, with echo) gives null logprobs."""
    tokens = [decode([t]) for t in token_ids]
    offsets = [offset + sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
    return {
        "tokens": tokens,
        "token_logprobs": [
            None if lp is None else lp.get(t) for t, lp in zip(token_ids, logprobs, strict=True)
        ],
        "top_logprobs": [
            None if lp is None else {decode([i]): v for i, v in _top(lp, n)} for lp in logprobs
        ],
        "text_offset": offsets,
    }


def join_logprobs(first: dict[str, list], then: dict[str, list]) -> dict[str, list]:
    return {key: first[key] + then[key] for key in first}


def prompt_logprobs(
    decode, token_ids: Sequence[int], logprobs: Sequence[dict[int, float] | None], n: int
) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else its top-n and its
    own, keyed by token id: {"logprob", "decoded_token"}."""
    out: list[dict[str, dict] | None] = []
    for token, lp in zip(token_ids, logprobs, strict=True):
        if lp is None:
            out.append(None)
            continue
        picked = dict(_top(lp, n)) | {token: lp[token]}
        out.append(
            {str(i): {"logprob": v, "decoded_token": decode([i])} for i, v in picked.items()}
        )
    return out


def chat_logprobs(
    decode, token_ids: list[int], logprobs: list[dict[int, float]], n: int
) -> dict[str, list]:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def entry(token_id: int, logprob: float | None) -> dict[str, Any]:
        text = decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [
        entry(t, lp.get(t)) | {"top_logprobs": [entry(i, v) for i, v in _top(lp, n)]}
        for t, lp in zip(token_ids, logprobs, strict=True)
    ]
    return {"content": content}
