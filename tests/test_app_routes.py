"""The HTTP routes of server/app.py over a fake engine client: no model, so the file runs in
seconds and is app.py's mutation-test selection (benchmarks/mutation.py app). The fake records
what it was asked and replays outputs each test chooses; expected bodies are written out here,
not built with the server's own helpers."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from starlette.requests import ClientDisconnect

from ostinato.engine.async_engine import EngineClosedError, EngineOverloadedError
from ostinato.lora.request import LoRARequest
from ostinato.outputs import RequestOutput
from ostinato.sampling_params import SamplingParams, StructuredOutputsParams
from ostinato.server.app import build_app

# Ids below 1000 are one character (the code point); these are whole words, 1003 is an EOS.
WORDS = {1000: "Hello", 1001: " big", 1002: " world", 1003: ""}
HELLO = [1000, 1001, 1002]  # "Hello big world": tokens at characters 0, 5, 9


def decode(ids: list[int]) -> str:
    return "".join(WORDS[i] if i in WORDS else chr(i) for i in ids)


def encode(text: str) -> list[int]:
    """A word of WORDS is one token, as a real tokenizer merges it; any other character is one."""
    ids, at = [], 0
    while at < len(text):
        word = next((i for i, w in WORDS.items() if w and text.startswith(w, at)), None)
        ids.append(ord(text[at]) if word is None else word)
        at += 1 if word is None else len(WORDS[word])
    return ids


class FakeTokenizer:
    def __init__(self) -> None:
        self.templates: list[tuple[list[dict], list[dict] | None]] = []

    encode = staticmethod(encode)
    decode = staticmethod(decode)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None):
        self.templates.append((messages, tools))
        if any(m["content"] == "unrenderable" for m in messages):
            raise ValueError("the template cannot render this conversation")
        return encode("".join(f"{m['role']}>{m['content']};" for m in messages))


def steps(
    prompt: list[int],
    tokens: list[int],
    finish: str = "stop",
    logprobs: list[dict[int, float]] | None = None,
    prompt_logprobs: list | None = None,
    texts: list[str] | None = None,
    error: str | None = None,
) -> list[RequestOutput]:
    """One request's outputs as an engine streams them: a token a step, each cumulative;
    `texts` gives each step's text where it is not the tokens' (a stop string cut)."""
    outs = []
    for k in range(1, len(tokens) + 1):
        done = k == len(tokens)
        outs.append(
            RequestOutput(
                request_id="",
                prompt_token_ids=prompt,
                token_ids=tokens[:k],
                text=texts[k - 1] if texts else decode(tokens[:k]),
                new_token_ids=tokens[k - 1 : k],
                finished=done,
                finish_reason=finish if done else None,
                error=error if done else None,
                logprobs=None if logprobs is None else logprobs[:k],
                prompt_logprobs=prompt_logprobs,
            )
        )
    return outs


Reply = Callable[[list[int], SamplingParams, int], list[RequestOutput]]


class FakeStream:
    """RequestStream's interface: outputs of the group in turn (step k of each request, then
    step k + 1); with `engine.hang` it never ends once they are out."""

    def __init__(self, engine: FakeEngine, ids: list[str], replies: list[list[RequestOutput]]):
        self.engine = engine
        self.unfinished = set(ids)
        longest = max(len(r) for r in replies)
        self.outs = [
            replace(reply[k], request_id=rid)
            for k in range(longest)
            for rid, reply in zip(ids, replies, strict=True)
            if k < len(reply)
        ]

    def __aiter__(self):
        return self._outputs()

    async def _outputs(self):
        for out in self.outs:
            await asyncio.sleep(0)
            if out.finished:
                self.unfinished.discard(out.request_id)
            yield out
        if self.engine.hang:
            await asyncio.Event().wait()

    def abort(self) -> None:
        self.engine.aborted += sorted(self.unfinished)
        self.unfinished.clear()


class FakeEngine:
    """What OpenAIServer calls on an engine client (AsyncEngine's or EngineCoreClient's)."""

    def __init__(self, max_model_len: int = 32) -> None:
        self.tokenizer = FakeTokenizer()
        self.config = SimpleNamespace(max_model_len=max_model_len)
        self.on_finish = None
        self.is_running = True
        self.calls: list[tuple[list, list[str], LoRARequest | None]] = []
        self.aborted: list[str] = []
        self.registered: list[LoRARequest] = []
        self.events: list[str] = []
        self.add_error: Exception | None = None
        self.hang = False
        self.stats = {"num_running": 3}
        self.report = {"steps": {"full": 7}}
        self.reply: Reply = lambda prompt, params, j: steps(prompt, encode("ok"))

    def start(self) -> None:
        self.events.append("start")

    async def shutdown(self) -> None:
        self.events.append("shutdown")

    def register_lora(self, adapter: LoRARequest) -> str:
        self.registered.append(adapter)
        return adapter.name

    async def stats_and_report(self) -> tuple[dict, dict]:
        return self.stats, self.report

    async def add(self, requests, request_ids, lora_request) -> FakeStream:
        self.calls.append((requests, request_ids, lora_request))
        if self.add_error is not None:
            raise self.add_error
        replies = []
        for j, (prompt, params) in enumerate(requests):
            ids = encode(prompt) if isinstance(prompt, str) else prompt
            replies.append(self.reply(ids, params, j))
        return FakeStream(self, request_ids, replies)

    @property
    def params(self) -> list[SamplingParams]:
        """The last call's sampling parameters, one per choice."""
        return [p for _, p in self.calls[-1][0]]


ADAPTER = LoRARequest("ad", "/adapters/ad")
USER = [{"role": "user", "content": "hi"}]
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "s", "schema": {}}}


def serve(engine: FakeEngine, **kwargs) -> TestClient:
    return TestClient(build_app(engine, ["m", "alias"], **kwargs))


def post(client: TestClient, path: str, status: int = 200, **body) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


def complete(client: TestClient, status: int = 200, **body) -> dict:
    return post(client, "/v1/completions", status, **({"model": "m"} | body))


def chat(client: TestClient, status: int = 200, **body) -> dict:
    return post(client, "/v1/chat/completions", status, **({"model": "m", "messages": USER} | body))


def events(client: TestClient, path: str, **body) -> list:
    """A stream's events: each `data: JSON` parsed, the last one "[DONE]"."""
    r = client.post(path, json=body | {"stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    parts = r.text.split("\n\n")
    assert parts[-1] == "" and all(p.startswith("data: ") for p in parts[:-1]), r.text
    data = [p.removeprefix("data: ") for p in parts[:-1]]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]] + ["[DONE]"]


def error(message: str, param: str | None, code: str | None = None, type_: str | None = None):
    return {
        "error": {
            "message": message,
            "type": type_ or "invalid_request_error",
            "param": param,
            "code": code,
        }
    }


def only_choice(chunk: dict) -> dict:
    (choice,) = chunk["choices"]
    return choice


# -- bodies -------------------------------------------------------------------------------


def test_a_completion_body_and_the_request_the_engine_got():
    engine = FakeEngine()
    before = int(time.time())
    body = complete(serve(engine), prompt="Hi")
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", body.pop("id"))
    assert before <= body.pop("created") <= time.time()
    assert body == {
        "object": "text_completion",
        "model": "m",
        "choices": [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4},
    }
    ((requests, ids, lora),) = engine.calls
    assert requests == [("Hi", SamplingParams(max_tokens=16))] and lora is None
    assert len(ids) == 1 and ids[0].startswith("cmpl-") and ids[0].endswith("-0")


def test_a_chat_body_and_the_template_it_rendered():
    engine = FakeEngine()
    body = chat(serve(engine), model="alias", max_tokens=5)
    call_id = body.pop("id")
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", call_id)
    assert time.time() - 5 <= body.pop("created") <= time.time()
    message = {"role": "assistant", "content": "ok"}
    assert body == {
        "object": "chat.completion",
        "model": "alias",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10},  # "user>hi;"
    }
    assert engine.tokenizer.templates == [([{"role": "user", "content": "hi"}], None)]
    ((requests, ids, lora),) = engine.calls
    assert requests == [(encode("user>hi;"), SamplingParams(max_tokens=5))]
    assert ids == [f"{call_id}-0"] and lora is None


def test_n_choices_of_a_batch_of_prompts_count_each_prompt_once():
    engine = FakeEngine()
    lengths = iter([1, 2, 3, 4])
    engine.reply = lambda prompt, params, j: steps(prompt, encode("xyzw"[: next(lengths)]))
    body = complete(serve(engine), prompt=["abc", "de"], n=2, seed=5, max_tokens=4)
    choices = [(c["index"], c["text"]) for c in body["choices"]]
    assert choices == [(0, "x"), (1, "xy"), (2, "xyz"), (3, "xyzw")]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15}
    requests, ids, _ = engine.calls[0]
    assert [p for p, _ in requests] == ["abc", "abc", "de", "de"]
    assert [p.seed for _, p in requests] == [5, 6, 5, 6]  # each choice its own seed
    assert ids == [f"{body['id']}-{i}" for i in range(4)]


def test_chat_usage_with_n_counts_the_prompt_once():
    engine = FakeEngine()
    engine.reply = lambda prompt, params, j: steps(prompt, encode("ab"[: j + 1]))
    body = chat(serve(engine), n=2, max_tokens=3)
    assert [c["message"]["content"] for c in body["choices"]] == ["a", "ab"]
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11}


def test_max_tokens_left_out_fills_what_the_context_has_left():
    engine = FakeEngine(max_model_len=10)
    client = serve(engine)
    complete(client, prompt=["abcd", "x" * 20], max_tokens=None)
    assert [p.max_tokens for p in engine.params] == [6, 1]
    complete(client, prompt=[5, 6, 7], max_tokens=None)
    assert engine.params[0].max_tokens == 7
    complete(client, prompt="Hello big", max_tokens=None)  # two tokens, nine characters
    assert engine.params[0].max_tokens == 8
    complete(client, prompt="abcdefghi", max_tokens=None)  # one token of room left
    assert engine.params[0].max_tokens == 1
    complete(client, prompt="abcd", max_tokens=3)
    assert engine.params[0].max_tokens == 3
    engine.config.max_model_len = 32
    client = serve(engine)
    chat(client)  # the template's 8 tokens
    assert engine.params[0].max_tokens == 24
    chat(client, max_tokens=5, max_completion_tokens=7)
    assert engine.params[0].max_tokens == 7
    chat(client, max_tokens=5)
    assert engine.params[0].max_tokens == 5


def test_sampling_fields_reach_the_engine():
    engine = FakeEngine()
    client = serve(engine)
    fields = {"temperature": 0.5, "top_p": 0.9, "top_k": 4, "stop": ["END"], "min_tokens": 1}
    complete(client, prompt="Hi", max_tokens=5, **fields)
    assert engine.params == [
        SamplingParams(
            temperature=0.5, top_p=0.9, top_k=4, stop=["END"], min_tokens=1, max_tokens=5
        )
    ]
    chat(client, max_tokens=5, **fields)
    assert engine.params == [
        SamplingParams(
            temperature=0.5, top_p=0.9, top_k=4, stop=["END"], min_tokens=1, max_tokens=5
        )
    ]


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {"response_format": SCHEMA_FORMAT},
            StructuredOutputsParams(json={}),
        ),
        ({"response_format": {"type": "text"}}, None),
    ],
)
def test_structured_outputs_reach_the_engine(fields, want):
    engine = FakeEngine()
    client = serve(engine)
    complete(client, prompt="Hi", n=2, **fields)
    assert [p.structured_outputs for p in engine.params] == [want, want]
    chat(client, **fields)
    assert engine.params[0].structured_outputs == want


# -- logprobs and echo ----------------------------------------------------------------------

LOGPROBS = [{1000: -0.5, 1001: -1.5}, {1001: -0.25, 1002: -0.125}, {1002: -2.0, 1000: -1.0}]


def prompt_logprobs(prompt: list[int]) -> list:
    """The first prompt token has none; each other token scores -3, the next id -0.75 and the
    one after -5 (for "Hi", [72, 105]: [None, {105: -3.0, 106: -0.75, 107: -5.0}])."""
    return [None] + [{t: -3.0, t + 1: -0.75, t + 2: -5.0} for t in prompt[1:]]


def scored(prompt, params, j):
    lps = LOGPROBS if params.logprobs is not None else None
    prompt_lps = prompt_logprobs(prompt) if params.prompt_logprobs is not None else None
    return steps(prompt, HELLO, "length", logprobs=lps, prompt_logprobs=prompt_lps)


COMPLETION_LOGPROBS = {
    "tokens": ["Hello", " big", " world"],
    "token_logprobs": [-0.5, -0.25, -2.0],
    "top_logprobs": [{"Hello": -0.5}, {" world": -0.125}, {"Hello": -1.0}],
    "text_offset": [0, 5, 9],
}


def test_completion_logprobs_values_and_text_offsets():
    engine = FakeEngine()
    engine.reply = scored
    (choice,) = complete(serve(engine), prompt="Hi", logprobs=1)["choices"]
    assert choice == {
        "index": 0,
        "text": "Hello big world",
        "logprobs": COMPLETION_LOGPROBS,
        "finish_reason": "length",
    }
    assert engine.params[0].logprobs == 1 and engine.params[0].prompt_logprobs is None


def test_completion_logprobs_streamed_carry_the_same_offsets():
    engine = FakeEngine()
    engine.reply = scored
    chunks = events(serve(engine), "/v1/completions", model="m", prompt="Hi", logprobs=1)
    assert [only_choice(c)["logprobs"]["text_offset"] for c in chunks[:-1]] == [[0], [5], [9]]
    assert [only_choice(c)["logprobs"]["token_logprobs"] for c in chunks[:-1]] == [
        [-0.5],
        [-0.25],
        [-2.0],
    ]


def test_echo_puts_the_prompt_and_its_token_logprobs_first():
    engine = FakeEngine()
    engine.reply = scored
    client = serve(engine)
    (choice,) = complete(client, prompt="Hi", echo=True, logprobs=1)["choices"]
    assert choice["text"] == "HiHello big world"
    assert choice["logprobs"] == {
        "tokens": ["H", "i", "Hello", " big", " world"],
        "token_logprobs": [None, -3.0, -0.5, -0.25, -2.0],
        "top_logprobs": [None, {"j": -0.75}, {"Hello": -0.5}, {" world": -0.125}, {"Hello": -1.0}],
        "text_offset": [0, 1, 2, 7, 11],
    }
    assert engine.params[0].prompt_logprobs == 1  # echo's logprobs need the prompt's
    (choice,) = complete(client, prompt="Hi", echo=True)["choices"]
    assert choice["text"] == "HiHello big world" and choice["logprobs"] is None
    assert engine.params[0].prompt_logprobs is None


def test_echo_of_token_prompts_with_n_gives_each_choice_its_prompt():
    engine = FakeEngine()
    body = complete(serve(engine), prompt=[[72, 105], [106]], echo=True, n=2)
    assert [c["text"] for c in body["choices"]] == ["Hiok", "Hiok", "jok", "jok"]


def test_echo_streamed_comes_once_before_the_completion():
    engine = FakeEngine()
    engine.reply = scored
    chunks = events(serve(engine), "/v1/completions", model="m", prompt="Hi", echo=True, logprobs=1)
    texts = [only_choice(c)["text"] for c in chunks[:-1]]
    assert texts == ["HiHello", " big", " world"]
    offsets = [only_choice(c)["logprobs"]["text_offset"] for c in chunks[:-1]]
    assert offsets == [[0, 1, 2], [7], [11]]
    first = only_choice(chunks[0])["logprobs"]
    assert first["tokens"] == ["H", "i", "Hello"] and first["token_logprobs"] == [None, -3.0, -0.5]


def test_chat_logprobs_carry_values_bytes_and_top_entries():
    engine = FakeEngine()
    engine.reply = scored
    client = serve(engine)
    (choice,) = chat(client, logprobs=True, top_logprobs=2)["choices"]
    hello = {"token": "Hello", "logprob": -0.5, "bytes": [72, 101, 108, 108, 111]}
    big = {"token": " big", "logprob": -0.25, "bytes": [32, 98, 105, 103]}
    world = {"token": " world", "logprob": -2.0, "bytes": [32, 119, 111, 114, 108, 100]}
    assert choice["logprobs"] == {
        "content": [
            hello | {"top_logprobs": [hello, big | {"logprob": -1.5}]},
            big | {"top_logprobs": [world | {"logprob": -0.125}, big]},
            world | {"top_logprobs": [hello | {"logprob": -1.0}, world]},
        ]
    }
    assert engine.params[0].logprobs == 2
    (choice,) = chat(client, logprobs=True)["choices"]
    assert [e["top_logprobs"] for e in choice["logprobs"]["content"]] == [[], [], []]
    assert engine.params[0].logprobs == 0
    (choice,) = chat(client, top_logprobs=2)["choices"]
    assert choice["logprobs"] is None and engine.params[0].logprobs is None


def test_logprobs_asked_for_but_not_given_are_null():
    engine = FakeEngine()  # the fake's reply has no logprobs
    (choice,) = complete(serve(engine), prompt="Hi", logprobs=1)["choices"]
    assert choice["logprobs"] is None


def prompt_scores(text: str) -> list:
    """vLLM's prompt_logprobs of `scored`'s prompt at top 1: the next id and the token's own."""
    return [None] + [
        {
            str(ord(c) + 1): {"logprob": -0.75, "decoded_token": chr(ord(c) + 1)},
            str(ord(c)): {"logprob": -3.0, "decoded_token": c},
        }
        for c in text[1:]
    ]


PROMPT_SCORES = [
    None,
    {
        "106": {"logprob": -0.75, "decoded_token": "j"},
        "105": {"logprob": -3.0, "decoded_token": "i"},
    },
]


def test_prompt_logprobs_on_each_completion_choice_and_beside_chat_choices():
    engine = FakeEngine()
    engine.reply = scored
    client = serve(engine)
    body = complete(client, prompt="Hi", n=2, prompt_logprobs=1)
    assert [c["prompt_logprobs"] for c in body["choices"]] == [PROMPT_SCORES, PROMPT_SCORES]
    assert engine.params[0].prompt_logprobs == 1 and "prompt_logprobs" not in body
    body = chat(client, n=2, prompt_logprobs=1)
    assert body["prompt_logprobs"] == prompt_scores("user>hi;")
    assert all("prompt_logprobs" not in c for c in body["choices"])
    assert engine.params[1].prompt_logprobs == 1
    body = chat(client)
    assert "prompt_logprobs" not in body and "prompt_logprobs" not in body["choices"][0]


def test_prompt_logprobs_streamed_come_with_each_choices_first_chunk():
    engine = FakeEngine()
    engine.reply = scored
    chunks = events(serve(engine), "/v1/completions", model="m", prompt="Hi", prompt_logprobs=1)
    firsts = [only_choice(c).get("prompt_logprobs", "absent") for c in chunks[:-1]]
    assert firsts == [PROMPT_SCORES, "absent", "absent"]


# -- streams --------------------------------------------------------------------------------


def test_a_completion_stream_chunk_by_chunk():
    engine = FakeEngine()
    engine.reply = lambda prompt, params, j: steps(prompt, [*HELLO, 1003])
    chunks = events(serve(engine), "/v1/completions", model="m", prompt="Hi")
    ids = {c.pop("id") for c in chunks[:-1]}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    assert {c.pop("created") for c in chunks[:-1]} <= {int(time.time()), int(time.time()) - 1}
    envelope = {"object": "text_completion", "model": "m", "usage": None}
    assert chunks == [
        envelope | {"choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": f}]}
        for t, f in [("Hello", None), (" big", None), (" world", None), ("", "stop")]
    ] + ["[DONE]"]
    assert engine.aborted == []


def test_a_chat_stream_opens_each_choice_with_its_role():
    engine = FakeEngine()
    engine.reply = lambda prompt, params, j: steps(prompt, HELLO[: j + 1], "length")
    chunks = events(serve(engine), "/v1/chat/completions", model="m", messages=USER, n=2)
    assert len({c.pop("id") for c in chunks[:-1]}) == 1
    for c in chunks[:-1]:
        c.pop("created")
    envelope = {"object": "chat.completion.chunk", "model": "m", "usage": None}
    role = {"role": "assistant", "content": ""}
    delta = [
        (0, "Hello", "length"),  # choice 0's one token
        (1, "Hello", None),
        (1, " big", "length"),
    ]
    assert chunks == [
        envelope | {"choices": [{"index": 0, "delta": role}, {"index": 1, "delta": role}]},
        *[
            envelope
            | {
                "choices": [
                    {"index": i, "delta": {"content": t}, "logprobs": None, "finish_reason": f}
                ]
            }
            for i, t, f in delta
        ],
        "[DONE]",
    ]


def test_include_usage_adds_a_last_chunk_with_the_counts():
    engine = FakeEngine()
    engine.reply = lambda prompt, params, j: steps(prompt, HELLO[: j + 1])
    for path, fields, prompt_tokens in [
        ("/v1/completions", {"prompt": "Hi"}, 2),
        ("/v1/chat/completions", {"messages": USER}, 8),
    ]:
        usage = {"include_usage": True}
        chunks = events(serve(engine), path, model="m", n=2, stream_options=usage, **fields)
        last = chunks[-2]
        assert last["choices"] == [] and last["model"] == "m"
        assert last["object"] == chunks[0]["object"]  # a chat stream's chunks are all .chunk
        assert last["usage"] == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 3,
            "total_tokens": prompt_tokens + 3,
        }
        assert all(c["usage"] is None for c in chunks[:-2])
        plain = events(serve(engine), path, model="m", n=2, **fields)
        assert all(c["choices"] for c in plain[:-1])


def test_text_that_may_begin_a_stop_string_is_held_back():
    engine = FakeEngine()
    texts = ["a", "ab", "abE", "abEN", "abENx"]  # "END" never completes
    engine.reply = lambda prompt, params, j: steps(prompt, encode("abENx"), "length", texts=texts)
    client = serve(engine)
    chunks = events(client, "/v1/completions", model="m", prompt="Hi", stop=["ZZ", "END"])
    assert [only_choice(c)["text"] for c in chunks[:-1]] == ["a", "b", "ENx"]
    assert engine.params[0].stop == ["ZZ", "END"]
    chunks = events(client, "/v1/completions", model="m", prompt="Hi", stop="EN")
    assert [only_choice(c)["text"] for c in chunks[:-1]] == ["a", "b", "EN", "x"]


def test_a_held_back_step_with_logprobs_sends_them_with_no_text():
    engine = FakeEngine()
    texts = ["a", "ab", "abE", "abEN", "abENx"]
    lps = [{t: -0.5} for t in encode("abENx")]
    engine.reply = lambda prompt, params, j: steps(
        prompt, encode("abENx"), "length", logprobs=lps, texts=texts
    )
    chunks = events(
        serve(engine), "/v1/completions", model="m", prompt="Hi", stop="END", logprobs=0
    )
    got = [(only_choice(c)["text"], only_choice(c)["logprobs"]) for c in chunks[:-1]]
    assert [(text, lp["tokens"], lp["text_offset"]) for text, lp in got] == [
        ("a", ["a"], [0]),
        ("b", ["b"], [1]),
        ("", ["E"], [2]),
        ("", ["N"], [3]),
        ("ENx", ["x"], [4]),  # where the non-streamed logprobs put it
    ]


def test_a_reply_that_ends_in_a_stop_prefix_sends_it_at_the_end():
    engine = FakeEngine()
    engine.reply = lambda prompt, params, j: steps(prompt, encode("aE"), "length")
    chunks = events(serve(engine), "/v1/completions", model="m", prompt="Hi", stop="END")
    assert [(only_choice(c)["text"], only_choice(c)["finish_reason"]) for c in chunks[:-1]] == [
        ("a", None),
        ("E", "length"),
    ]


def test_a_stream_of_a_stop_string_cut_at_the_end():
    engine = FakeEngine()
    texts = ["a", "aE", "aEN", "a"]  # "END" completes: the engine cuts it and stops
    engine.reply = lambda prompt, params, j: steps(prompt, encode("aEND"), texts=texts)
    chunks = events(serve(engine), "/v1/completions", model="m", prompt="Hi", stop="END")
    assert [(only_choice(c)["text"], only_choice(c)["finish_reason"]) for c in chunks[:-1]] == [
        ("a", None),
        ("", "stop"),
    ]


# -- tools ----------------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "g"}},
]
CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'


def replying(text: str, finish: str = "stop") -> Reply:
    return lambda prompt, params, j: steps(prompt, encode(text), finish)


def tool_chat(engine: FakeEngine, parser: str | None = "hermes", status: int = 200, **body):
    client = serve(engine, tool_call_parser=parser)
    return chat(client, status, tools=TOOLS, **body)


def test_a_reply_with_a_tool_call_is_a_tool_calls_message():
    engine = FakeEngine()
    engine.reply = replying("Sure. " + CALL)
    (choice,) = tool_chat(engine)["choices"]
    (call,) = choice["message"].pop("tool_calls")
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.pop("id"))
    assert call == {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    assert choice == {
        "index": 0,
        "message": {"role": "assistant", "content": "Sure."},
        "logprobs": None,
        "finish_reason": "tool_calls",
    }
    assert engine.tokenizer.templates[0][1] == TOOLS  # the template shows the model the tools
    assert engine.params[0].structured_outputs is None  # tool_choice auto: nothing forced


def test_a_tool_call_without_other_text_has_null_content_and_length_stays():
    engine = FakeEngine()
    engine.reply = replying(CALL, "length")
    (choice,) = tool_chat(engine)["choices"]
    assert choice["message"]["content"] is None and choice["finish_reason"] == "length"
    assert len(choice["message"]["tool_calls"]) == 1


def test_a_reply_without_a_call_is_plain_text():
    engine = FakeEngine()
    engine.reply = replying("<tool_call>not json</tool_call>")
    (choice,) = tool_chat(engine)["choices"]
    assert choice["message"] == {"role": "assistant", "content": "<tool_call>not json</tool_call>"}
    assert choice["finish_reason"] == "stop"


def test_tool_choice_none_shows_no_tools_and_parses_no_calls():
    engine = FakeEngine()
    engine.reply = replying(CALL)
    (choice,) = tool_chat(engine, parser=None, tool_choice="none")["choices"]
    assert choice["message"] == {"role": "assistant", "content": CALL}
    assert engine.tokenizer.templates[0][1] is None


def test_tools_without_a_parser_are_refused_by_name():
    message = (
        "tools need a tool call parser: start the server with --tool-call-parser "
        "(hermes or llama3_json, the format of the model's calls)"
    )
    assert tool_chat(FakeEngine(), parser=None, status=400) == error(message, "tools")


def test_a_streamed_tool_call_comes_whole_in_the_last_chunk():
    engine = FakeEngine()
    engine.reply = replying("Sure. " + CALL + " Done")
    client = serve(engine, tool_call_parser="hermes")
    chunks = events(client, "/v1/chat/completions", model="m", messages=USER, tools=TOOLS)
    deltas = [only_choice(c)["delta"] for c in chunks[1:-1]]
    assert "".join(d.get("content", "") for d in deltas[:-1]) == "Sure. "
    last = deltas[-1]
    (call,) = last.pop("tool_calls")
    assert call.pop("index") == 0 and call["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert last == {"content": " Done"}
    assert only_choice(chunks[-2])["finish_reason"] == "tool_calls"


def test_a_streamed_tool_call_after_all_the_text_has_no_content():
    engine = FakeEngine()
    engine.reply = replying("Sure. " + CALL + CALL.replace('"f"', '"g"') + "\n")
    client = serve(engine, tool_call_parser="hermes")
    chunks = events(client, "/v1/chat/completions", model="m", messages=USER, tools=TOOLS)
    last = only_choice(chunks[-2])["delta"]
    assert list(last) == ["tool_calls"]
    assert [(c["index"], c["function"]["name"]) for c in last["tool_calls"]] == [(0, "f"), (1, "g")]


@pytest.mark.parametrize(
    ("choice", "parallel", "start"),
    [
        ("required", True, "start: call+\n"),
        ("required", False, "start: call\n"),
        ({"type": "function", "function": {"name": "g"}}, True, "start: call\n"),
    ],
)
def test_a_forced_tool_choice_constrains_the_output(choice, parallel, start):
    engine = FakeEngine()
    engine.reply = replying(CALL)
    tool_chat(engine, tool_choice=choice, parallel_tool_calls=parallel)
    grammar = engine.params[0].structured_outputs.grammar
    assert grammar.startswith(start)
    assert ('"const": "g"' in grammar) and (('"const": "f"' in grammar) == (choice == "required"))


def test_a_forced_tool_choice_with_a_response_format_is_refused():
    engine = FakeEngine()
    body = tool_chat(
        engine, status=400, tool_choice="required", response_format={"type": "json_object"}
    )
    message = "a forced tool_choice cannot be combined with a response format"
    assert body == error(message, "tool_choice") and engine.calls == []
    tool_chat(engine, response_format={"type": "json_object"})  # auto: the format applies
    assert engine.params[0].structured_outputs == StructuredOutputsParams(json_object=True)


def test_unknown_tool_call_parser_is_refused_at_start():
    message = "unknown tool call parser 'xml': choose hermes, llama3_json"
    with pytest.raises(ValueError, match=re.escape(message)):
        build_app(FakeEngine(), ["m"], tool_call_parser="xml")


# -- errors ---------------------------------------------------------------------------------


def test_an_unknown_model_is_404_naming_the_served_ones():
    engine = FakeEngine()
    client = TestClient(build_app(engine, ["m", "alias"], adapters=[ADAPTER]))
    message = "The model `x` does not exist; this server has ['m', 'alias', 'ad']"
    want = error(message, "model", "model_not_found")
    assert complete(client, 404, model="x", prompt="Hi") == want
    assert chat(client, 404, model="x") == want
    assert engine.calls == []


def test_an_adapter_named_as_model_runs_the_request_through_it():
    engine = FakeEngine()
    client = TestClient(build_app(engine, ["m", "alias"], adapters=[ADAPTER]))
    assert engine.registered == [ADAPTER]
    assert complete(client, model="ad", prompt="Hi")["model"] == "ad"
    assert engine.calls[-1][2] == ADAPTER
    chat(client, model="ad")
    assert engine.calls[-1][2] == ADAPTER
    chat(client, model="alias")
    assert engine.calls[-1][2] is None


def test_adapter_names_must_differ_from_the_models_and_each_other():
    for adapters in ([LoRARequest("alias", "/a")], [ADAPTER, LoRARequest("ad", "/b")]):
        name = adapters[-1].name
        message = f"LoRA module name {name!r} is taken: names of served models and adapters must"
        with pytest.raises(ValueError, match=re.escape(message)):
            build_app(FakeEngine(), ["m", "alias"], adapters=adapters)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Hi", "suffix": "x"}),
        ("/v1/chat/completions", {"messages": USER, "suffix": "x"}),
    ],
)
def test_an_unsupported_field_is_a_400_naming_it(path, body):
    engine = FakeEngine()
    r = serve(engine).post(path, json={"model": "m"} | body)
    message = (
        "suffix: this server does not support the field 'suffix' (with this value); remove it "
        "(see the README's list of supported fields)"
    )
    assert r.status_code == 400 and r.json() == error(message, "suffix")
    assert engine.calls == []


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        (
            {"model": "m", "prompt": "Hi", "n": 0},
            "n: Input should be greater than or equal to 1",
            "n",
        ),
        ({"prompt": "Hi"}, "model: Field required", "model"),
        (
            {"model": "m", "prompt": "Hi", "stream_options": {"include_usage": "maybe"}},
            "stream_options.include_usage: Input should be a valid boolean, unable to interpret "
            "input",
            "stream_options",
        ),
        (
            [1, 2],
            "request body: Input should be a valid dictionary or object to extract fields from",
            None,
        ),
    ],
)
def test_a_body_that_does_not_validate_is_a_400_naming_the_field(body, message, param):
    r = serve(FakeEngine()).post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json() == error(message, param)


def test_a_body_that_is_not_json_is_a_400():
    r = serve(FakeEngine()).post(
        "/v1/completions", content=b"{", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert r.json() == error("invalid JSON body: JSON decode error", None)


def test_http_errors_come_in_openai_shape():
    client = serve(FakeEngine())
    r = client.get("/v2/nothing")
    assert r.status_code == 404 and r.json() == error("Not Found", None)
    r = client.get("/v1/completions")
    assert r.status_code == 405 and r.json() == error("Method Not Allowed", None)
    assert r.headers["allow"] == "POST"


def test_the_api_is_titled_ostinato():
    assert serve(FakeEngine()).get("/openapi.json").json()["info"]["title"] == "ostinato"


@pytest.mark.parametrize(
    ("raised", "message", "param"),
    [
        (ValueError("temperature must be >= 0"), "temperature must be >= 0", "temperature"),
        (ValueError("the prompt is too long"), "the prompt is too long", "prompt"),
        (ValueError("too long"), "prompt: too long", "prompt"),
        (
            ValueError("structured_outputs.regex: unbalanced parenthesis"),
            "structured_outputs.regex: unbalanced parenthesis",
            "structured_outputs",
        ),
    ],
)
def test_a_value_error_of_the_engine_is_a_400_naming_the_field(raised, message, param):
    engine = FakeEngine()
    engine.add_error = raised
    body = {"structured_outputs": {"regex": "a"}} if param == "structured_outputs" else {}
    assert complete(serve(engine), 400, prompt="Hi", **body) == error(message, param)


@pytest.mark.parametrize(
    ("fields", "message", "param"),
    [
        ({"stop": ["END", ""]}, "stop strings must not be empty", "stop"),
        (
            {"seed": 2**64 - 1, "n": 2},  # the second choice's seed is one more
            "seed must fit in 64 bits, got 18446744073709551616",
            "seed",
        ),
    ],
)
def test_sampling_parameters_that_do_not_hold_are_a_400_naming_the_field(fields, message, param):
    engine = FakeEngine()
    client = serve(engine)
    assert complete(client, 400, prompt="Hi", **fields) == error(message, param)
    assert chat(client, 400, **fields) == error(message, param)
    assert engine.calls == []


def test_a_chat_value_error_names_messages():
    engine = FakeEngine()
    engine.add_error = ValueError("too long")
    assert chat(serve(engine), 400) == error("messages: too long", "messages")
    assert chat(
        serve(engine), 400, messages=[{"role": "user", "content": "unrenderable"}]
    ) == error("messages: the template cannot render this conversation", "messages")


@pytest.mark.parametrize(
    ("fields", "message", "param"),
    [
        (
            {"response_format": SCHEMA_FORMAT},
            "response_format.json_schema.schema: not valid JSON: Expecting value",
            "response_format",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required"},
            "tools: not valid JSON: Expecting value",
            "tools",
        ),
        (
            {"structured_outputs": {"json": "{"}},
            "structured_outputs.json: not valid JSON: Expecting value",
            "structured_outputs",
        ),
    ],
)
def test_a_grammar_error_names_the_field_the_grammar_came_from(fields, message, param):
    """The engine's message names structured_outputs.<kind>, whatever field the grammar came
    from; the rest of the message (colons and all) is kept."""
    engine = FakeEngine()
    engine.add_error = ValueError("structured_outputs.json: not valid JSON: Expecting value")
    body = chat(serve(engine, tool_call_parser="hermes"), 400, **fields)
    assert body == error(message, param)


def test_an_overloaded_engine_is_a_503_to_retry():
    engine = FakeEngine()
    engine.add_error = EngineOverloadedError("too many requests waiting (3, limit 2); retry later")
    r = serve(engine).post("/v1/completions", json={"model": "m", "prompt": "Hi"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    message = "too many requests waiting (3, limit 2); retry later"
    assert r.json() == error(message, None, "queue_full", "server_error")


def test_a_closing_engine_is_a_503():
    engine = FakeEngine()
    engine.add_error = EngineClosedError("the server is shutting down")
    r = serve(engine).post("/v1/chat/completions", json={"model": "m", "messages": USER})
    assert r.status_code == 503 and "retry-after" not in r.headers
    assert r.json() == error("the server is shutting down", None, "shutting_down", "server_error")


@pytest.mark.parametrize(
    ("finish", "message", "status", "code", "want"),
    [
        ("error", "engine error: boom", 500, "request_failed", "engine error: boom"),
        ("error", None, 500, "request_failed", "request failed"),
        ("abort", "the server is shutting down", 503, "aborted", "the server is shutting down"),
        ("abort", None, 503, "aborted", "request aborted"),
    ],
)
def test_a_failed_request_is_an_error_not_a_choice(finish, message, status, code, want):
    engine = FakeEngine()
    engine.reply = lambda prompt, params, j: steps(
        prompt, encode("ab"), finish if j == 1 else "stop", error=message if j == 1 else None
    )
    body = complete(serve(engine), status, prompt="Hi", n=2)
    assert body == error(want, None, code, "server_error")


def test_a_failure_mid_stream_is_an_error_event_and_aborts_the_rest():
    engine = FakeEngine()
    engine.reply = lambda prompt, params, j: (
        steps(prompt, encode("abc"))
        if j == 0
        else steps(prompt, encode("x"), "error", error="boom")
    )
    chunks = events(
        serve(engine),
        "/v1/completions",
        model="m",
        prompt="Hi",
        n=2,
        stream_options={"include_usage": True},
    )
    call_id = chunks[0]["id"]
    assert [only_choice(c)["text"] for c in chunks[:1]] == ["a"]
    assert chunks[1:] == [error("boom", None, "request_failed", "server_error"), "[DONE]"]
    assert engine.aborted == [f"{call_id}-0"]


# -- disconnects ----------------------------------------------------------------------------


async def asgi_post(
    app, path: str, body: dict, gone: asyncio.Event, spec: str = "2.0", send=None, stray=()
):
    """Drive the app as a server would; `gone` set: the client has disconnected. `stray`:
    messages received after the body, before the disconnect."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("test", 1),
        "server": ("test", 80),
    }
    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    pending += stray

    async def receive():
        if pending:
            return pending.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    sent = []

    async def record(message):
        sent.append(message)
        if send is not None:
            await send(message)

    await app(scope, receive, record)
    return sent


def test_a_client_gone_before_the_answer_aborts_its_requests():
    async def main():
        engine = FakeEngine()
        engine.hang = True  # the reply never finishes
        engine.reply = lambda prompt, params, j: steps(prompt, encode("ab"))[:1]
        gone = asyncio.Event()
        app = build_app(engine, ["m"])
        body = {"model": "m", "prompt": "Hi", "n": 2}
        task = asyncio.ensure_future(asgi_post(app, "/v1/completions", body, gone))
        for _ in range(20):
            await asyncio.sleep(0)
        assert engine.calls and engine.aborted == [] and not task.done()
        gone.set()
        start, end = await task
        assert start["status"] == 499
        call_id = engine.calls[0][1][0].removesuffix("-0")
        assert sorted(engine.aborted) == [f"{call_id}-0", f"{call_id}-1"]
        assert json.loads(end["body"]) == error("client closed the request", None, "client_closed")

    asyncio.run(asyncio.wait_for(main(), 10))


def test_only_a_disconnect_message_means_the_client_has_gone():
    async def main():
        engine = FakeEngine()
        engine.reply = replying("ok" * 20)  # many steps: the stray message comes first
        app = build_app(engine, ["m"])
        stray = [{"type": "http.request", "body": b"", "more_body": False}]
        body = {"model": "m", "prompt": "Hi", "max_tokens": 40}
        start, end = await asgi_post(app, "/v1/completions", body, asyncio.Event(), stray=stray)
        assert start["status"] == 200
        assert json.loads(end["body"])["choices"][0]["text"] == "ok" * 20
        assert engine.aborted == []

    asyncio.run(asyncio.wait_for(main(), 10))


@pytest.mark.parametrize("spec", ["2.0", "2.4"])
def test_a_client_gone_mid_stream_aborts_its_requests(spec):
    """ASGI 2.0: the disconnect message cancels the stream; 2.4: the failed send does."""

    async def main():
        engine = FakeEngine()
        engine.hang = True
        engine.reply = lambda prompt, params, j: steps(prompt, encode("abc"))[:2]
        gone = asyncio.Event()

        async def send(message):
            if message.get("body", b"").startswith(b"data: ") and b'"b"' in message["body"]:
                if spec == "2.4":
                    raise OSError("connection reset")
                gone.set()

        app = build_app(engine, ["m"])
        body = {"model": "m", "prompt": "Hi", "stream": True}
        if spec == "2.4":
            with pytest.raises(ClientDisconnect):  # what the server is told of the failed send
                await asgi_post(app, "/v1/completions", body, gone, spec, send)
        else:
            sent = await asgi_post(app, "/v1/completions", body, gone, spec, send)
            assert all(b"[DONE]" not in m.get("body", b"") for m in sent)
        assert engine.aborted == [engine.calls[0][1][0]]

    asyncio.run(asyncio.wait_for(main(), 10))


# -- the other routes -----------------------------------------------------------------------


def test_models_lists_the_names_then_the_adapters():
    client = TestClient(build_app(FakeEngine(max_model_len=77), ["m", "alias"], adapters=[ADAPTER]))
    before = int(time.time())
    body = client.get("/v1/models").json()
    cards = body.pop("data")
    assert body == {"object": "list"}
    assert all(before <= card.pop("created") <= time.time() for card in cards)
    card = {"object": "model", "owned_by": "ostinato", "max_model_len": 77}
    assert cards == [
        card | {"id": "m"},
        card | {"id": "alias"},
        card | {"id": "ad", "parent": "m", "root": "/adapters/ad"},
    ]


def test_health_follows_the_engine():
    engine = FakeEngine()
    client = serve(engine)
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    engine.is_running = False
    r = client.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "engine stopped"}


def test_metrics_render_the_engine_stats_and_the_finished_requests():
    engine = FakeEngine()
    client = serve(engine)
    engine.on_finish("stop", 0.2, None)  # the server observes what the engine finishes
    r = client.get("/metrics")
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    lines = r.text.splitlines()
    assert "ostinato_requests_running 3" in lines
    assert 'ostinato_requests_finished_total{finish_reason="stop"} 1' in lines
    assert 'ostinato_graph_steps_total{mode="full"} 7' in lines
    assert "ostinato_time_to_first_token_seconds_count 1" in lines


def test_the_lifespan_starts_and_stops_the_engine():
    engine = FakeEngine()
    app = build_app(engine, ["m"])
    assert app.state.async_engine is engine
    with TestClient(app) as client:
        assert engine.events == ["start"]
        complete(client, prompt="Hi")
    assert engine.events == ["start", "shutdown"]
