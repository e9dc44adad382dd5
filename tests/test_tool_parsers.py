"""Tool call parsers and the chat template's tools, without a server."""

from __future__ import annotations

import json

from helpers import make_tokenizer

from ostinato.server.tools import HermesParser, Llama3JsonParser
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
