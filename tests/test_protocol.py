"""The server's request models and response shapes without a server: what each field becomes,
the 400s with their messages and fields, and the logprobs objects computed by hand.
tests/test_server*.py send the same through a live server."""

from __future__ import annotations

import contextlib

import pydantic
import pytest

from ostinato.sampling_params import SamplingParams, StructuredOutputsParams
from ostinato.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    FunctionDefinition,
    bad_value,
    chat_logprobs,
    completion_logprobs,
    error_body,
    join_logprobs,
    prompt_logprobs,
    usage,
)

VOCAB = {1: "a", 2: "bc", 3: "é", 4: "d"}


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(model="m", prompt="hi", **fields)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


@contextlib.contextmanager
def raises_api_error(message: str, param: str):
    """The block raises an APIError 400 with this message, naming this field."""
    with pytest.raises(APIError) as info:
        yield
    assert (info.value.status, info.value.message, info.value.param) == (400, message, param)


# ---- errors ------------------------------------------------------------------------------
def test_an_error_body_has_openai_s_shape():
    error = APIError(429, "slow down", "n", type_="rate_limit", code="busy", headers={"a": "1"})
    assert error.body() == {
        "error": {"message": "slow down", "type": "rate_limit", "param": "n", "code": "busy"}
    }
    assert (error.status, error.headers, str(error)) == (429, {"a": "1"}, "slow down")
    plain = APIError(400, "bad")
    assert plain.body() == error_body("bad", "invalid_request_error", None, None)
    assert plain.body()["error"]["type"] == "invalid_request_error" and plain.headers is None


@pytest.mark.parametrize(
    "field",
    ["temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "logprobs",
     "prompt_logprobs", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
     "repetition_penalty", "logit_bias", "structured_outputs"],
)  # fmt: skip
def test_a_sampling_error_names_the_field_it_begins_with(field):
    error = bad_value(ValueError(f"{field} must be better, got 3"), "prompt")
    assert (error.status, error.message, error.param) == (
        400,
        f"{field} must be better, got 3",
        field,
    )


def test_an_error_naming_no_field_is_given_the_default_field():
    error = bad_value(ValueError("the prompt is too long"), "prompt")
    assert (error.message, error.param) == ("the prompt is too long", "prompt")  # named already
    error = bad_value(ValueError("too long"), "messages")
    assert (error.message, error.param) == ("messages: too long", "messages")


# ---- fields -----------------------------------------------------------------------------
def test_fields_become_sampling_params():
    body = completion(
        temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=10, min_tokens=2, stop="end",
        stop_token_ids=[7], ignore_eos=True, presence_penalty=0.5, frequency_penalty=-0.5,
        repetition_penalty=1.2, logit_bias={"3": 1.5},
    )  # fmt: skip
    constraint = StructuredOutputsParams(regex="a+")
    params = body.sampling_params(8, 2, choice=3, prompt_logprobs=1, constraint=constraint)
    assert params == SamplingParams(
        temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=13, max_tokens=8, min_tokens=2,
        stop=["end"], stop_token_ids=[7], ignore_eos=True, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={3: 1.5}, logprobs=2,
        prompt_logprobs=1, structured_outputs=constraint,
    )  # fmt: skip
    assert completion(stop=["x", "y"]).sampling_params(8, None, 0).stop == ["x", "y"]
    defaults = completion().sampling_params(16, None, 0)
    assert defaults == SamplingParams(max_tokens=16)  # every default is SamplingParams's
    assert defaults.seed is None and defaults.stop == [] and defaults.logit_bias == {}


def test_defaults_and_bounds_of_the_request_models():
    assert completion().max_tokens == 16 and chat().max_tokens is None  # OpenAI's defaults
    assert (
        chat().max_completion_tokens is None
        and chat(max_completion_tokens=5).max_completion_tokens == 5
    )
    assert chat().parallel_tool_calls is True and completion().echo is False
    for field, ok, bad in [("n", (1, 128), (0, 129)), ("logprobs", (0, 20), (-1, 21)),
                           ("prompt_logprobs", (0, 20), (-1, 21))]:  # fmt: skip
        for value in ok:
            assert getattr(completion(**{field: value}), field) == value
        for value in bad:
            with pytest.raises(pydantic.ValidationError, match=field):
                completion(**{field: value})
    assert chat(top_logprobs=20).top_logprobs == 20
    for value in (-1, 21):
        with pytest.raises(pydantic.ValidationError, match="top_logprobs"):
            chat(top_logprobs=value)
    with pytest.raises(pydantic.ValidationError, match="messages"):
        ChatCompletionRequest(model="m", messages=[])


def test_include_usage_needs_stream_options():
    assert not completion().include_usage
    assert not completion(stream_options={}).include_usage
    assert completion(stream_options={"include_usage": True}).include_usage


@pytest.mark.parametrize(
    "name", ["user", "safety_identifier", "prompt_cache_key", "service_tier", "metadata"]
)
def test_fields_openai_ignores_are_ignored(name):
    assert completion(**{name: {"any": "value"}}).unsupported_field() is None


def test_store_is_ignored_only_when_false():
    assert completion(store=False).unsupported_field() is None
    error = completion(store=True).unsupported_field()
    assert error.param == "store" and error.status == 400


def test_an_unknown_field_is_a_400_naming_it():
    error = chat(temprature=0.5, user="u").unsupported_field()
    assert (error.status, error.param, error.message) == (
        400,
        "temprature",
        "temprature: this server does not support the field 'temprature' (with this value); "
        "remove it (see the README's list of supported fields)",
    )
    assert chat().unsupported_field() is None


def test_best_of_must_equal_n():
    error = completion(n=2, best_of=3).unsupported_field()
    assert (error.status, error.param, error.message) == (
        400,
        "best_of",
        "best_of: only best_of equal to n (2) is supported, got 3; leave it out and ask for n "
        "completions",
    )
    assert completion(n=2, best_of=2).unsupported_field() is None
    assert completion(n=2, best_of=2, odd=1).unsupported_field().param == "odd"


@pytest.mark.parametrize(
    ("fields", "needed"),
    [({}, None), ({"prompt_logprobs": 2}, 2), ({"logprobs": 3}, None),
     ({"logprobs": 3, "echo": True}, 3), ({"logprobs": 3, "echo": True, "prompt_logprobs": 5}, 5),
     ({"logprobs": 4, "echo": True, "prompt_logprobs": 1}, 4), ({"echo": True}, None),
     ({"logprobs": 0, "echo": True}, 0)],
)  # fmt: skip
def test_prompt_logprobs_needed_by_prompt_logprobs_and_echo(fields, needed):
    assert completion(**fields).prompt_logprobs_needed() == needed


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_a_prompt_is_a_text_a_token_list_or_a_batch_of_either(prompt, prompts):
    assert CompletionRequest(model="m", prompt=prompt).prompts() == prompts


@pytest.mark.parametrize("prompt", ["", [], ["a", ""], [[1], []]])
def test_an_empty_prompt_is_a_400(prompt):
    with raises_api_error("prompt must not be empty", "prompt"):
        CompletionRequest(model="m", prompt=prompt).prompts()


# ---- structured outputs -------------------------------------------------------------------
def test_constraints_from_response_format_and_structured_outputs():
    schema = {"type": "object"}
    assert completion().constraint() is None
    assert completion(response_format={"type": "text"}).constraint() is None
    assert completion(response_format={"type": "json_object"}).constraint() == (
        StructuredOutputsParams(json_object=True)
    )
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert completion(response_format=fmt).constraint() == StructuredOutputsParams(json=schema)
    extension = {"json": schema, "json_object": None, "regex": None}
    assert completion(structured_outputs=extension).constraint() == (
        StructuredOutputsParams(json=schema)
    )
    for kind, value in [("regex", "a+"), ("choice", ["x", "y"]), ("grammar", "start: 'a'")]:
        assert completion(structured_outputs={kind: value}).constraint() == (
            StructuredOutputsParams(**{kind: value})
        )
    assert completion(structured_outputs={"json_object": True}).constraint() == (
        StructuredOutputsParams(json_object=True)
    )
    text_and_extension = {"response_format": {"type": "text"}, "structured_outputs": {"regex": "a"}}
    assert completion(**text_and_extension).constraint() == StructuredOutputsParams(regex="a")


def test_constraint_errors_name_their_field():
    with raises_api_error(
        "give response_format or structured_outputs, not both", "response_format"
    ):
        completion(
            response_format={"type": "json_object"}, structured_outputs={"regex": "a"}
        ).constraint()
    with raises_api_error(
        "response_format.json_schema is required when type is json_schema", "response_format"
    ):
        completion(response_format={"type": "json_schema"}).constraint()
    with raises_api_error(
        "structured_outputs: give exactly one of json, json_object, regex, choice, grammar, not "
        "regex and grammar",
        "structured_outputs",
    ):
        completion(structured_outputs={"regex": "a", "grammar": "b"}).constraint()


def test_the_field_a_constraint_error_names():
    assert completion(structured_outputs={"regex": "a"}).constraint_field == "structured_outputs"
    fmt = {"type": "json_object"}
    assert completion(response_format=fmt).constraint_field == "response_format.json_schema.schema"
    assert chat().constraint_field == "tools"


# ---- chat ---------------------------------------------------------------------------------
def test_messages_as_chat_templates_read_them():
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
    ]
    body = ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "system", "content": None},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"},
                                         {"type": "text", "text": "b"}], "name": "ann"},
            {"role": "assistant", "tool_calls": calls},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
    )  # fmt: skip
    assert body.chat() == [
        {"role": "system", "content": ""},
        {"role": "user", "content": "ab", "name": "ann"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "g", "arguments": "not json"},
                },
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert calls[0]["function"]["arguments"] == '{"x": 1}'  # the request is left as it came
    no_function = ChatMessage(role="assistant", tool_calls=[{"id": "c3"}])
    assert no_function.template_dict()["tool_calls"] == [{"id": "c3", "function": {}}]


def test_only_text_content_parts_are_supported():
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]
    message = ChatMessage(role="user", content=parts)
    with raises_api_error("messages: only text content parts are supported", "messages"):
        message.text()


def test_num_logprobs_of_a_chat_request():
    assert chat().num_logprobs() is None
    assert chat(top_logprobs=3).num_logprobs() is None  # without logprobs=true
    assert chat(logprobs=True).num_logprobs() == 0
    assert chat(logprobs=True, top_logprobs=3).num_logprobs() == 3


TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "g", "description": "G"}},
]


def test_tools_shown_to_the_model_and_the_ones_a_call_must_use():
    shown = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "g", "description": "G"}},
    ]
    assert chat(tools=TOOLS).tool_dicts() == shown
    assert chat(tools=TOOLS, tool_choice="auto").tool_dicts() == shown
    assert chat(tools=TOOLS, tool_choice="none").tool_dicts() is None
    assert chat().tool_dicts() is None
    assert chat(tools=TOOLS, tool_choice="required").forced_tools(shown) == shown
    assert chat(tools=TOOLS, tool_choice="auto").forced_tools(shown) is None
    named = {"type": "function", "function": {"name": "g"}}
    assert chat(tools=TOOLS, tool_choice=named).forced_tools(shown) == [shown[1]]
    missing = {"type": "function", "function": {"name": "h"}}
    with raises_api_error("tool_choice names 'h', which is not in tools", "tool_choice"):
        chat(tools=TOOLS, tool_choice=missing).forced_tools(shown)
    with raises_api_error("tool_choice needs tools", "tool_choice"):
        chat(tool_choice="auto").tool_dicts()
    with raises_api_error("tool_choice needs tools", "tool_choice"):
        chat(tools=[], tool_choice="none").tool_dicts()


@pytest.mark.parametrize(
    ("name", "ok"),
    [("get_weather-2", True), ("a" * 64, True), ("a" * 65, False), ("has space", False),
     ("", False)],
)  # fmt: skip
def test_function_names_follow_openai_s_pattern(name, ok):
    if ok:
        assert FunctionDefinition(name=name).name == name
    else:
        with pytest.raises(pydantic.ValidationError):
            FunctionDefinition(name=name)


# ---- responses -----------------------------------------------------------------------------
def test_usage_totals_the_tokens():
    assert usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_completion_logprobs_with_offsets_and_the_top_n():
    lps = [None, {2: -0.5, 1: -1.0, 4: -3.0}, {3: -2.0, 4: -0.1, 1: -0.2}]
    got = completion_logprobs(decode, [1, 2, 3], lps, n=2, offset=10)
    assert got == {
        "tokens": ["a", "bc", "é"],
        "token_logprobs": [None, -0.5, -2.0],
        "top_logprobs": [None, {"bc": -0.5, "a": -1.0}, {"d": -0.1, "a": -0.2}],
        "text_offset": [10, 11, 13],  # characters, from the offset
    }
    assert list(got["top_logprobs"][2]) == ["d", "a"]  # best first
    assert completion_logprobs(decode, [4], [{1: -1.0}], 1, 0)["token_logprobs"] == [None]
    joined = join_logprobs(got, completion_logprobs(decode, [4], [{4: -0.3}], 1, 14))
    assert joined["tokens"] == ["a", "bc", "é", "d"] and joined["text_offset"] == [10, 11, 13, 14]
    assert joined["token_logprobs"] == [None, -0.5, -2.0, -0.3]


def test_prompt_logprobs_keep_each_token_s_own_beside_the_top_n():
    lps = [None, {2: -0.5, 1: -1.0, 4: -3.0}, {3: -2.0, 4: -0.1, 1: -0.2}]
    assert prompt_logprobs(decode, [1, 2, 3], lps, n=1) == [
        None,
        {"2": {"logprob": -0.5, "decoded_token": "bc"}},
        {
            "4": {"logprob": -0.1, "decoded_token": "d"},
            "3": {"logprob": -2.0, "decoded_token": "é"},  # its own, outside the top 1
        },
    ]
    assert prompt_logprobs(decode, [2], [{2: -0.5, 1: -1.0}], n=0) == [
        {"2": {"logprob": -0.5, "decoded_token": "bc"}}
    ]


def test_chat_logprobs_carry_bytes_and_the_top_n():
    lps = [{3: -0.2, 1: -2.0, 2: -1.0}, {4: -0.7}]
    e = lambda text, lp: {"token": text, "logprob": lp, "bytes": list(text.encode())}  # noqa: E731
    assert chat_logprobs(decode, [3, 1], lps, n=2) == {
        "content": [
            e("é", -0.2) | {"top_logprobs": [e("é", -0.2), e("bc", -1.0)]},
            e("a", None) | {"top_logprobs": [e("d", -0.7)]},
        ]
    }
    assert chat_logprobs(decode, [3], lps[:1], n=0)["content"][0]["bytes"] == [0xC3, 0xA9]
