"""Tool call parsers and the chat template's tools, without a server."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers import make_tokenizer

from ostinato.server.tools import HermesParser, Llama3JsonParser, ToolCall
from ostinato.structured.grammar import JSON_OPTIONS
from ostinato.tokenizer import HFTokenizer

TOOLS_TEMPLATE = (
    "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_hermes_parses_calls_and_keeps_the_text_around_them():
    p = HermesParser()
    text = 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
    text += '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = p.parse(text)
    assert content.strip() == "Let me look."
    assert [(c.name, c.arguments) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert json.loads(calls[0].openai()["function"]["arguments"]) == {"x": 1}
    assert p.parse("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert p.parse("plain") == ("plain", [])
    assert p.held_from("abc <tool") == 4  # a stream holds what may begin a call
    assert p.held_from("abc <tool_call>{") == 4
    assert p.held_from("abc") == 3


def test_llama3_json_parses_one_or_several_calls():
    p = Llama3JsonParser()
    content, calls = p.parse('<|python_tag|>{"name": "f", "parameters": {"x": 1}}')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", {"x": 1})]
    _, calls = p.parse('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"y": 2}}')
    assert [c.name for c in calls] == ["f", "g"]
    assert p.parse("Hello there") == ("Hello there", [])
    assert p.parse('{"no": "name"}') == ('{"no": "name"}', [])
    assert p.held_from("  {") == 2 and p.held_from("Hi") == 2


def test_the_template_renders_the_tools(tmp_path):
    hf = make_tokenizer()
    hf.chat_template = TOOLS_TEMPLATE
    hf.save_pretrained(tmp_path)
    tok = HFTokenizer(str(tmp_path))
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    messages = [{"role": "user", "content": "hi"}]
    with_tools = tok.tokenizer.decode(tok.apply_chat_template(messages, tools=tools))
    assert "<|tools|>" in with_tools and "get_time" in with_tools
    assert "get_time" not in tok.tokenizer.decode(tok.apply_chat_template(messages))


def test_parsers_take_either_arguments_key_and_hand_string_arguments_on_as_they_are():
    """A call's arguments under the parser's other key are its arguments too, a call without
    any is a call without arguments; held text starts at the first call; a llama3_json
    separator may have spaces before it; string arguments reach the client unencoded."""
    hermes, llama = HermesParser(), Llama3JsonParser()
    _, calls = hermes.parse('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("f", {"x": 1})]
    _, calls = hermes.parse('<tool_call>{"name": "f"}</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("f", {})]
    assert hermes.held_from("a <tool_call>{}</tool_call> b <tool_call>") == 2
    _, calls = llama.parse('{"name": "f", "arguments": {"y": 2}} ; {"name": "g"}')
    assert [(c.name, c.arguments) for c in calls] == [("f", {"y": 2}), ("g", {})]
    assert ToolCall("f", '{"x": 1}').openai()["function"]["arguments"] == '{"x": 1}'


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },  # fmt: skip
    {"type": "function", "function": {"name": "get_time"}},
]


def forced_schema(params, key: str) -> dict:
    """The JSON schema inside a forcing constraint: a Lark grammar's %json rule (whose
    llguidance options must be ours) or the constraint's own schema."""
    if params.json is not None:
        return params.json
    rule = params.grammar.split(f"{key}: %json ", 1)[1].split("\n", 1)[0]
    schema = json.loads(rule)
    assert schema.pop("x-guidance") == JSON_OPTIONS
    return schema


@pytest.mark.parametrize("parser, key", [(HermesParser(), "arguments"),
                                         (Llama3JsonParser(), "parameters")])  # fmt: skip
def test_a_forced_call_names_one_of_the_tools_with_arguments_matching_its_schema(parser, key):
    """tool_choice required or named: the constraint's schema accepts a call of any given tool
    whose arguments match that tool's parameters (any object for a tool without them), and
    refuses another name, missing arguments, arguments off their schema or not an object,
    extra keys and a call that is not an object; with one tool, its schema alone. Several
    calls: hermes repeats its call rule, llama3_json joins calls with '; '."""
    for many in (False, True):
        params = parser.constraint(TOOLS, many)
        schema = forced_schema(params, "body" if parser.name == "hermes" else "call")
        good = [{"name": "get_weather", key: {"city": "Oslo"}}, {"name": "get_time", key: {}}]
        bad = [{"name": "get_date", key: {}}, {"name": "get_weather"},
               {"name": "get_weather", key: {"city": 3}},
               {"name": "get_time", key: {}, "extra": 1}, {"name": "get_time", key: 3},
               "get_time"]  # fmt: skip
        for call in good:
            jsonschema.validate(call, schema)
        for call in bad:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(call, schema)
    if parser.name == "hermes":
        assert params.grammar.startswith('start: call+\ncall: "<tool_call>\\n" body')
        assert parser.constraint(TOOLS, False).grammar.startswith("start: call\n")
    else:
        assert params.grammar.startswith('start: call ("; " call)*\ncall: %json ')
    one = forced_schema(parser.constraint(TOOLS[:1], False), "body")
    assert "anyOf" not in one and one["properties"]["name"] == {"const": "get_weather"}
