"""What the HTTP process and the engine-core process say to each other over ZeroMQ.

Every message is a msgspec Struct, encoded as MessagePack by msgspec: no wire format is
written by hand. SamplingParams and LoRARequest travel as the dataclasses they are, every
field included, so a field added to them crosses with no change here (msgspec decodes into
the dataclass and runs its __post_init__). Token ids cross, never text.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ostinato.lora.request import LoRARequest
from ostinato.sampling_params import SamplingParams


# ---- HTTP process -> engine core (the input socket) ------------------------------------------
class NewRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class Add(msgspec.Struct, tag=True):
    """A group of requests (the n choices of one API call): all are added or none, and the
    core answers with a Reply carrying call_id."""

    call_id: int
    requests: list[NewRequest]
    lora: LoRARequest | None = None


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class Query(msgspec.Struct, tag=True):
    """Ask for engine reports; the Reply's result is {"stats": ..., "graph_report": ...}."""

    call_id: int


class Shutdown(msgspec.Struct, tag=True):
    pass


Input = Add | Abort | Query | Shutdown


# ---- engine core -> HTTP process (the output socket) -----------------------------------------
class Delta(msgspec.Struct, array_like=True):
    """What one step added to a request: its new tokens (and their logprobs), and why it
    ended, if it did."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    num_cached_tokens: int
    # on a request's first delta only: each prompt position's logprobs (the first None)
    prompt_logprobs: list[dict[int, float] | None] | None = None


class Step(msgspec.Struct, tag=True):
    outputs: list[Delta]


class Reply(msgspec.Struct, tag=True):
    """The answer to an Add or a Query. error_kind: "invalid" (the request is bad),
    "overloaded" (the waiting queue is full) or "error"."""

    call_id: int
    result: Any = None
    error: str | None = None
    error_kind: str | None = None


class Ready(msgspec.Struct, tag=True):
    num_blocks: int


class Dead(msgspec.Struct, tag=True):
    """The core stops for good (it failed to start, a step failed, a worker died); `reason`
    is what clients read. error_kind "invalid": a bad start-up argument (a LoRA adapter)."""

    reason: str
    error_kind: str | None = None


Output = Step | Reply | Ready | Dead


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Input)


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Output)
