"""OpenAI request bodies and the JSON shapes of responses, chunks and errors."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from ostinato.sampling_params import SamplingParams

# Request fields a SamplingParams error can name; its messages begin with the field's name.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "logprobs", "stop")


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

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, logprobs: int | None, choice: int) -> SamplingParams:
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

    def text(self) -> str:
        """The content as text; parts other than text are refused."""
        if not isinstance(self.content, list):
            return self.content or ""
        if any(part.get("type") != "text" for part in self.content):
            raise APIError(400, "messages: only text content parts are supported", "messages")
        return "".join(part.get("text", "") for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


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
