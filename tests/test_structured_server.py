"""Structured outputs and tool calling through the official openai client against a live
server on the tiny model (random weights: only the grammar makes the output parse)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from test_server import CONFIG, Server, _flags

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Forecast", "parameters": SCHEMA},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
SAMPLE = {"temperature": 1.0, "seed": 3, "max_tokens": 200}  # escapes make strings long


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = CONFIG | {"max_model_len": 1024}  # tools in the prompt take bytes
    flags = [*_flags(config), "--tool-call-parser", "hermes"]
    srv = Server(flags, tmp_path_factory.mktemp("structured") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _chat(client, stream: bool, **kw) -> tuple[str, str | None, list[dict]]:
    """Text, finish reason and tool calls of one chat choice, streamed or not."""
    kw = {"model": "tiny", "messages": MESSAGES, **SAMPLE, **kw}
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [c.function.model_dump() for c in choice.message.tool_calls or []]
        return choice.message.content or "", choice.finish_reason, calls
    text, finish, calls = "", None, {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for c in choice.delta.tool_calls or []:
                entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
                entry["name"] += c.function.name or ""
                entry["arguments"] += c.function.arguments or ""
    return text, finish, [calls[i] for i in sorted(calls)]


def _completion(client, stream: bool, **kw) -> tuple[str, str | None]:
    kw = {"model": "tiny", "prompt": "The answer is", **SAMPLE, **kw}
    if not stream:
        choice = client.completions.create(**kw).choices[0]
        return choice.text, choice.finish_reason
    text, finish = "", None
    for chunk in client.completions.create(stream=True, **kw):
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_on_chat_and_completions(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    for seed in (1, 2, 3):
        text, finish = _chat(client, stream, response_format=fmt, seed=seed)[:2]
        jsonschema.validate(json.loads(text), SCHEMA)
        assert finish == "stop"
    text, finish = _completion(client, stream, extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(text), SCHEMA)
    assert finish == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_json_object(client, stream):
    free = _chat(client, False, temperature=0.0)[0]
    with pytest.raises(json.JSONDecodeError):  # random weights write no JSON by themselves
        json.loads(free)
    text, finish = _chat(client, stream, response_format={"type": "json_object"})[:2]
    assert isinstance(json.loads(text), dict) and finish == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_structured_outputs_extension(client, stream):
    so = {"regex": r"[A-Z][a-z]{2,5} [0-9]{1,3}"}
    text, finish = _completion(client, stream, extra_body={"structured_outputs": so})
    assert re.fullmatch(so["regex"], text) and finish == "stop"
    choices = ["red", "green", "light blue"]
    body = {"structured_outputs": {"choice": choices}}
    assert _chat(client, stream, extra_body=body)[0] in choices
    body = {"structured_outputs": {"grammar": 'start: "go " ("left" | "right")'}}
    assert re.fullmatch("go (left|right)", _chat(client, stream, extra_body=body)[0])
    body = {"structured_outputs": {"json": SCHEMA}}
    jsonschema.validate(json.loads(_completion(client, stream, extra_body=body)[0]), SCHEMA)


def _error(client, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **kw)
    return info.value


def test_bad_requests_are_400_naming_the_field(client, server):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    err = _error(client, response_format=bad)
    assert "response_format.json_schema.schema" in err.message and "objectx" in err.message
    err = _error(client, extra_body={"structured_outputs": {"regex": "[a-"}})
    assert err.body["param"] == "structured_outputs" and "regex" in err.message
    err = _error(client, extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert "exactly one of" in err.message
    err = _error(client, extra_body={"structured_outputs": {"regexp": "a"}})
    assert "regexp" in err.message  # an unknown field is refused, not ignored
    err = _error(client, response_format={"type": "json_schema"})
    assert "json_schema is required" in err.message
    err = _error(client, response_format={"type": "yaml"})
    assert "response_format" in err.message
    err = _error(client, tools=[WEATHER], tool_choice={"type": "function",
                                                       "function": {"name": "nope"}})  # fmt: skip
    assert "'nope'" in err.message
    err = _error(client, tool_choice="required")
    assert err.body["param"] == "tool_choice"
    # the server keeps serving
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "a",
                                                         "max_tokens": 2}, timeout=30)  # fmt: skip
    assert r.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_parse(client, stream):
    named = {"type": "function", "function": {"name": "get_time"}}
    text, finish, calls = _chat(client, stream, tools=[WEATHER, TIME], tool_choice=named)
    assert finish == "tool_calls" and len(calls) == 1 and text.strip() == ""
    assert calls[0]["name"] == "get_time"
    jsonschema.validate(json.loads(calls[0]["arguments"]), TIME["function"]["parameters"])
    text, finish, calls = _chat(client, stream, tools=[WEATHER, TIME], tool_choice="required",
                                parallel_tool_calls=False)  # fmt: skip
    assert finish == "tool_calls" and len(calls) == 1
    tool = {"get_weather": WEATHER, "get_time": TIME}[calls[0]["name"]]
    jsonschema.validate(json.loads(calls[0]["arguments"]), tool["function"]["parameters"])


def test_auto_and_none(client):
    """With auto the reply is text unless it holds a <tool_call> (random weights: text);
    with none the tools are not shown to the model at all."""
    text, finish, calls = _chat(client, False, tools=[WEATHER], max_tokens=8)
    assert calls == [] and finish == "length" and text
    with_none = _chat(client, False, tools=[WEATHER], tool_choice="none", temperature=0.0)
    assert with_none == _chat(client, False, temperature=0.0)  # same prompt as without tools
