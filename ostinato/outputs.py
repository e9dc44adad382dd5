"""What the engine hands back for a request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: Sequence[int]  # shared with the engine: read, never modify
    token_ids: list[int]  # every generated token so far
    text: str  # detokenized generated text so far (stop string removed)
    # tokens added since the consumer's previous output of this request (one step's, unless a
    # server stream fell behind and got several steps' at once: RequestStream)
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None  # per generated token: top-N id -> logprob
    # per prompt token (None for the first): top-N id -> logprob, and the prompt token's
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
