"""OpenAI request bodies and the JSON shapes of responses, chunks and errors."""

from __future__ import annotations

import contextlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ostinato.sampling_params import SamplingParams, StructuredOutputsParams

# Request fields a SamplingParams error can name; its messages begin with the field's name.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "logprobs",
    "stop",
    "structured_outputs",
)


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
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # extension
    n: int = Field(1, ge=1, le=128)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension: generate exactly max_tokens tokens
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # extension (vLLM)

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

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        choice: int,
        constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """Parameters of the choice-th of n samples; raises ValueError naming a bad field."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            # Each choice needs its own seed, or n seeded samples would all be the same.
            seed=None if self.seed is None else self.seed + choice,
            max_tokens=max_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            structured_outputs=constraint,
        )


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=20)

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
    decode, token_ids: list[int], logprobs: list[dict[int, float]], n: int, offset: int
) -> dict[str, list]:
    """The completions `logprobs` object; offsets count characters from `offset`."""
    tokens = [decode([t]) for t in token_ids]
    offsets = [offset + sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
    return {
        "tokens": tokens,
        "token_logprobs": [lp.get(t) for t, lp in zip(token_ids, logprobs, strict=True)],
        "top_logprobs": [{decode([i]): v for i, v in _top(lp, n)} for lp in logprobs],
        "text_offset": offsets,
    }


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
