"""Tool calling: the reply's tool calls in the model's own format, parsed back into OpenAI's
`tool_calls`, and the grammar that forces calls (tool_choice `required` or a named function).

One parser per format, chosen by `--tool-call-parser`:
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, Hermes)
- llama3_json: the reply is `{"name": ..., "parameters": {...}}`, several joined by `; `,
  optionally after `<|python_tag|>` (Llama 3.1 / 3.2)
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from ostinato.sampling_params import StructuredOutputsParams
from ostinato.structured.grammar import JSON_OPTIONS


@dataclass
class ToolCall:
    name: str
    arguments: Any  # usually a dict; sent to the client as JSON text

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """The `tool_calls` entry (with `index` in a streamed delta)."""
        args = self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments)
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"}
        call["function"] = {"name": self.name, "arguments": args}
        return call if index is None else {"index": index, **call}


class ToolParser(Protocol):
    name: str

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The reply's text outside tool calls, and its tool calls (none: all of it is text)."""

    def held_from(self, text: str) -> int:
        """Where text may begin a tool call: a stream sends nothing from there on until the
        reply ends and is parsed."""

    def constraint(self, tools: list[dict], many: bool) -> StructuredOutputsParams:
        """Output that is one call (several with `many`) of one of `tools` (OpenAI function
        definitions), with arguments matching its parameters schema."""


def _call_schema(tools: list[dict], arguments_key: str) -> dict:
    """A JSON schema: an object naming one of the tools, with its arguments."""
    options = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, arguments_key: params},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def _json_rule(schema: dict) -> str:
    """A Lark rule body for JSON matching schema, compact as response formats are."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def _as_call(obj: Any, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in arguments_keys if k in obj), None)
    return ToolCall(obj["name"], obj[key] if key is not None else {})


def _partial_tail(text: str, marker: str) -> int:
    """Where text ends with a proper prefix of marker (len(text) if it does not)."""
    cut = max((k for k in range(1, len(marker)) if text.endswith(marker[:k])), default=0)
    return len(text) - cut


class HermesParser:
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = []
        for match in self.CALL.finditer(text):
            try:
                call = _as_call(json.loads(match.group(1)), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return (self.CALL.sub("", text), calls) if calls else (text, [])

    def held_from(self, text: str) -> int:
        at = text.find(self.START)
        return at if at != -1 else _partial_tail(text, self.START)

    def constraint(self, tools: list[dict], many: bool) -> StructuredOutputsParams:
        body = _json_rule(_call_schema(tools, "arguments"))
        start = "start: call+" if many else "start: call"
        lark = f'{start}\ncall: "{self.START}\\n" body "\\n{self.END}"\nbody: {body}'
        return StructuredOutputsParams(grammar=lark)


class Llama3JsonParser:
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls, at, decoder = [], 0, json.JSONDecoder()
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = _as_call(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            rest = body[at:].lstrip()
            at = len(body) - len(rest.removeprefix(";").lstrip())
        return "", calls

    def held_from(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith(("{", self.TAG)) or self.TAG.startswith(stripped):
            return len(text) - len(stripped)
        return len(text)

    def constraint(self, tools: list[dict], many: bool) -> StructuredOutputsParams:
        schema = _call_schema(tools, "parameters")
        if not many:
            return StructuredOutputsParams(json=schema)
        body = _json_rule(schema)
        return StructuredOutputsParams(grammar=f'start: call ("; " call)*\ncall: {body}')


TOOL_PARSERS: dict[str, type] = {p.name: p for p in (HermesParser, Llama3JsonParser)}
