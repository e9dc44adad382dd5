"""Every sampling field of the API through the official openai client against a live server on
`tiny`: each changes the output as it should, streamed and not, and equals the offline engine
with the same settings; unknown fields are a 400 naming them."""

from __future__ import annotations

import httpx
import openai
import pytest
from test_server import CONFIG, Server, _flags

from ostinato import LLM, SamplingParams
from ostinato.config import EngineConfig

PROMPT = "1, 2, 3,"
A = 65  # the byte tokenizer's id of "A"
EOS = 257


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(_flags(CONFIG), tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm():
    return LLM(config=EngineConfig(**CONFIG))


def offline(llm, prompt, **kw):
    params = SamplingParams(**{"temperature": 0, "max_tokens": 12, **kw})
    return llm.generate([prompt], params, use_tqdm=False)[0]


def complete(client, stream: bool, chat: bool = False, **kw):
    """(text, finish_reason) of one greedy request of 12 tokens."""
    kw = {"model": "tiny", "max_tokens": 12, "temperature": 0, **kw}
    if chat:
        create = client.chat.completions.create
        kw["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        create = client.completions.create
        kw["prompt"] = PROMPT
    if not stream:
        choice = create(**kw).choices[0]
        return (choice.message.content if chat else choice.text), choice.finish_reason
    chunks = [c.choices[0] for c in create(**kw, stream=True) if c.choices]
    text = "".join((c.delta.content or "") if chat else c.text for c in chunks)
    return text, chunks[-1].finish_reason


SAMPLED = {"temperature": 1.0, "seed": 7}
LATE_STOP = {"min_tokens": 5, "stop_token_ids": [44]}
CASES = [  # (API fields: OpenAI's as keywords, vLLM's in extra_body; the same for the engine)
    ({"frequency_penalty": 2.0}, {"frequency_penalty": 2.0}),
    ({"presence_penalty": 1.5}, {"presence_penalty": 1.5}),
    ({"extra_body": {"repetition_penalty": 1.8}}, {"repetition_penalty": 1.8}),
    ({"logit_bias": {str(A): 100}}, {"logit_bias": {A: 100}}),
    ({"extra_body": {"min_p": 0.5}, **SAMPLED}, {"min_p": 0.5, **SAMPLED}),
    ({"extra_body": LATE_STOP}, LATE_STOP),
    ({"extra_body": {"stop_token_ids": [44]}}, {"stop_token_ids": [44]}),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "params"), CASES, ids=[str(p) for _, p in CASES])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_each_field_acts_as_in_the_engine_streamed_and_not(client, llm, fields, params, chat):
    prompt = (
        PROMPT
        if not chat
        else llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    )
    want = offline(llm, prompt, **params)
    plain = offline(llm, prompt, **{k: v for k, v in params.items() if k in SAMPLED})
    assert chat or want.token_ids != plain.token_ids  # the field changes this output
    for stream in (False, True):
        assert complete(client, stream, chat, **fields) == (want.text, want.finish_reason)


def test_fields_change_greedy_output_the_way_they_should(client):
    text, _ = complete(client, False)
    assert text == "," * 12  # greedy repeats itself on random weights
    penalized, _ = complete(client, False, frequency_penalty=2.0)
    assert penalized.count(",") == 1  # once said, a comma's logit sinks below the others
    assert complete(client, True, logit_bias={str(A): 100})[0] == "A" * 12
    assert complete(client, False, logit_bias={str(EOS): 100}) == ("", "stop")
    late = complete(client, True, logit_bias={str(EOS): 100}, extra_body={"min_tokens": 3})
    assert len(late[0]) == 3 and late[1] == "stop"  # EOS held back for three tokens


def test_echo_returns_the_prompt_and_its_logprobs(client, llm):
    generated = offline(llm, PROMPT, ignore_eos=True)
    r = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, echo=True
    )
    assert r.choices[0].text == PROMPT + generated.text
    chunks = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + generated.text
    want = offline(llm, PROMPT, prompt_logprobs=2, logprobs=2)
    ids = llm.tokenizer.encode(PROMPT)
    for stream in (False, True):
        r = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, echo=True, logprobs=2,
            stream=stream,
        )  # fmt: skip
        choices = [c.choices[0] for c in r] if stream else r.choices
        lp = choices[0].logprobs
        tokens = [t for c in choices for t in c.logprobs.tokens]
        values = [v for c in choices for v in c.logprobs.token_logprobs]
        assert "".join(tokens) == PROMPT + want.text
        assert values[0] is None and lp.top_logprobs[0] is None
        prompt_values = [want.prompt_logprobs[i][t] for i, t in enumerate(ids) if i]
        assert values[1 : len(ids)] == pytest.approx(prompt_values, abs=1e-4)
        output_values = [e[t] for e, t in zip(want.logprobs, want.token_ids, strict=True)]
        assert values[len(ids) :] == pytest.approx(output_values, abs=1e-4)
        offsets = [o for c in choices for o in c.logprobs.text_offset]
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_prompt_logprobs_extension(client, llm):
    want = offline(llm, PROMPT, prompt_logprobs=1)
    ids = llm.tokenizer.encode(PROMPT)
    r = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for i, entry in enumerate(got[1:], start=1):
        assert entry[str(ids[i])]["logprob"] == pytest.approx(
            want.prompt_logprobs[i][ids[i]], abs=1e-4
        )
        assert 1 <= len(entry) <= 2
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    prompt = llm.tokenizer.apply_chat_template(messages)
    scores = chat.model_extra["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(prompt)
    assert all(list(e) == [str(t)] for e, t in zip(scores[1:], prompt[1:], strict=True))
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1}
    )
    firsts = [c.choices[0].model_extra.get("prompt_logprobs") for c in stream]
    assert firsts[0] == got and not any(firsts[1:])


BAD = [  # (path, body changes, param, words the message must hold)
    ("completions", {"suffix": "x"}, "suffix", "does not support the field 'suffix'"),
    ("completions", {"frobnicate": 1}, "frobnicate", "frobnicate"),
    ("completions", {"store": True}, "store", "store"),
    ("completions", {"best_of": 3}, "best_of", "best_of"),
    ("completions", {"frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
    ("completions", {"presence_penalty": -2.5}, "presence_penalty", "[-2, 2]"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ("completions", {"min_p": 2}, "min_p", "[0, 1]"),
    ("completions", {"min_tokens": 9}, "min_tokens", "max_tokens=4"),
    ("completions", {"logit_bias": {"999": 1}}, "logit_bias", "vocabulary"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ("completions", {"logit_bias": {"x": 1}}, "logit_bias", "integer"),
    ("completions", {"stop_token_ids": [999]}, "stop_token_ids", "vocabulary"),
    ("completions", {"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs"),
    ("chat/completions", {"echo": True}, "echo", "echo"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "change", "param", "words"), BAD, ids=[b[2] for b in BAD])
def test_unknown_and_bad_fields_are_a_400_naming_them(server, path, change, param, words):
    body = {"model": "tiny", "max_tokens": 4}
    body |= {"prompt": "Hi"} if path == "completions" else {"messages": [{"role": "user"}]}
    r = httpx.post(f"{server.url}/v1/{path}", json=body | change, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_fields_openai_ignores_are_ignored(client):
    extra = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
    r = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_body=extra)
    assert r.choices[0].finish_reason
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, user="u1",
        n=2, extra_body={"safety_identifier": "s", "prompt_cache_key": "k"},
    )  # fmt: skip
    assert len(r.choices) == 2
    r = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, best_of=2, n=2)
    assert len(r.choices) == 2
