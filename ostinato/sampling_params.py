"""Per-request sampling and stopping settings: a plain dataclass, so a request travels as data."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GREEDY_BELOW = 1e-5  # temperatures this small are greedy: dividing logits by them overflows
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value


@dataclass
class StructuredOutputsParams:
    """What the output must match: exactly one of a JSON schema (a dict or its JSON text),
    any JSON object (json_object=True), a regular expression, one of a list of strings, or a
    Lark grammar (llguidance's dialect; vLLM's `structured_outputs` field)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs: give exactly one of {', '.join(KINDS)}"
                + (f", not {' and '.join(given)}" if given else "")
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs: choice must be a list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 means all tokens
    min_p: float = 0.0  # drop tokens below min_p times the most likely token's probability
    seed: int | None = None
    max_tokens: int = 64
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # subtracted once from every token the output holds
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # HF: logits of prompt and output tokens / p (> 0) or * p
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # return the top-N logprobs of each sampled position
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output
    prompt_logprobs: int | None = None  # return the top-N logprobs of each prompt position

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (all) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        self._check_token_ids()
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    def _check_token_ids(self) -> None:
        """Ids must be >= 0 here; the engine checks them against its vocabulary."""
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")
        for token, bias in self.logit_bias.items():
            if token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [-100, 100], got {bias} for token {token}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether sampling reads the request's tokens (penalties)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def token_ids(self) -> list[int]:
        """Every token id the request names (checked against the vocabulary by the engine)."""
        return [*self.stop_token_ids, *self.logit_bias]
