"""Every request field the server honours, checked by value: the app runs in-process (FastAPI's
TestClient) over a random Hugging Face checkpoint with a real BPE tokenizer, and logprobs are
checked against log_softmax of a transformers forward pass computed here."""

from __future__ import annotations

import pytest
import torch
import transformers
from fastapi.testclient import TestClient
from helpers import make_hf_checkpoint
from oracle import hf_model

from ostinato import LLM, SamplingParams
from ostinato.engine.async_engine import AsyncEngine
from ostinato.server.app import build_app

MAX_MODEL_LEN = 48
EXACT = {"ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint("qwen3", tmp_path_factory.mktemp("ckpt") / "qwen3")


def _llm(checkpoint) -> LLM:
    return LLM(str(checkpoint), device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """A second engine for expected outputs (the served one belongs to the app's loop)."""
    return _llm(checkpoint)


@pytest.fixture(scope="module")
def client(checkpoint):
    llm = _llm(checkpoint)
    with TestClient(build_app(AsyncEngine(llm.engine), ["m"])) as c:
        yield c


def post(client, path: str, **body) -> dict:
    r = client.post(f"/v1/{path}", json={"model": "m", **body})
    assert r.status_code == 200, r.text
    return r.json()


def greedy(llm: LLM, prompts: list, max_tokens: int) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


def test_max_completion_tokens_wins_over_max_tokens(client):
    messages = [{"role": "user", "content": "Hello there"}]
    body = {"messages": messages, "temperature": 0, **EXACT}
    r = post(client, "chat/completions", **body, max_completion_tokens=3, max_tokens=7)
    assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length"
    r = post(client, "chat/completions", **body, max_completion_tokens=5)
    assert r["usage"]["completion_tokens"] == 5


def test_list_of_text_parts_is_the_joined_text(client):
    def chat(content) -> dict:
        messages = [{"role": "user", "content": content}]
        return post(client, "chat/completions", messages=messages, max_tokens=6, temperature=0)

    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world!"}]
    joined, split, other = chat("Hello world!"), chat(parts), chat("Hello")
    assert split["usage"] == joined["usage"] != other["usage"]
    assert split["choices"][0]["message"] == joined["choices"][0]["message"]
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    body = {"model": "m", "messages": [{"role": "user", "content": image}]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "text content" in r.json()["error"]["message"]


def test_a_batch_of_token_id_prompts_answers_each_prompt(client, reference):
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    r = post(client, "completions", prompt=prompts, max_tokens=4, temperature=0, **EXACT)
    expected = greedy(reference, prompts, 4)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [c["text"] for c in r["choices"]] == [o.text for o in expected]
    assert r["usage"] == {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}
    one = post(client, "completions", prompt=prompts[1], max_tokens=4, temperature=0, **EXACT)
    assert one["choices"][0]["text"] == expected[1].text and len(one["choices"]) == 1


def test_an_omitted_max_tokens_fills_the_context(client, reference):
    prompt = [5, 6, 7, 8, 9]
    r = post(client, "completions", prompt=prompt, max_tokens=None, temperature=0, **EXACT)
    assert r["usage"]["completion_tokens"] == MAX_MODEL_LEN - len(prompt)
    assert r["choices"][0]["finish_reason"] == "length"
    default = post(client, "completions", prompt=prompt, temperature=0, **EXACT)
    assert default["usage"]["completion_tokens"] == 16  # OpenAI's completions default
    messages = [{"role": "user", "content": "Hi"}]
    chat_prompt = reference.tokenizer.apply_chat_template(messages)
    r = post(client, "chat/completions", messages=messages, temperature=0, **EXACT)
    assert r["usage"]["prompt_tokens"] == len(chat_prompt)
    assert r["usage"]["completion_tokens"] == MAX_MODEL_LEN - len(chat_prompt)


@torch.no_grad()
def test_logprob_values_and_text_offsets_match_a_transformers_forward(client, checkpoint):
    prompt = "The quick brown"
    r = post(client, "completions", prompt=prompt, max_tokens=5, temperature=0, logprobs=3, **EXACT)
    choice = r["choices"][0]
    lp = choice["logprobs"]
    tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    prompt_ids = tok(prompt)["input_ids"]
    model = hf_model(checkpoint)
    ids = torch.tensor([prompt_ids])
    generated = []
    for _ in range(5):  # greedy continuation, one token at a time, in float64
        logits = model(ids).logits[0, -1].double()
        logprobs = logits - torch.logsumexp(logits, dim=0)
        best = int(logprobs.argmax())
        generated.append((best, logprobs))
        ids = torch.cat([ids, torch.tensor([[best]])], dim=1)
    assert "".join(tok.decode([t]) for t, _ in generated) == choice["text"]
    assert lp["tokens"] == [tok.decode([t]) for t, _ in generated]
    for i, (token, logprobs) in enumerate(generated):
        assert lp["token_logprobs"][i] == pytest.approx(float(logprobs[token]), abs=1e-4)
        top = logprobs.topk(3)
        expected = {
            tok.decode([int(t)]): float(v) for t, v in zip(top.indices, top.values, strict=True)
        }
        assert lp["top_logprobs"][i] == pytest.approx(expected, abs=1e-4)
    texts = lp["tokens"]
    assert lp["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]


def test_chat_logprobs_carry_values_and_bytes(client, reference):
    messages = [{"role": "user", "content": "Hello"}]
    r = post(
        client,
        "chat/completions",
        messages=messages,
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        **EXACT,
    )
    content = r["choices"][0]["logprobs"]["content"]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)
    prompt = reference.tokenizer.apply_chat_template(messages)
    (out,) = reference.generate([prompt], params, use_tqdm=False)
    decode = reference.tokenizer.decode
    for entry, token, expected in zip(content, out.token_ids, out.logprobs, strict=True):
        assert entry["token"] == decode([token])
        assert entry["bytes"] == list(decode([token]).encode())
        assert entry["logprob"] == pytest.approx(expected[token], abs=1e-5)
        assert [e["logprob"] for e in entry["top_logprobs"]] == pytest.approx(
            sorted(expected.values(), reverse=True)[:2], abs=1e-5
        )
    r = post(client, "chat/completions", messages=messages, max_tokens=3, top_logprobs=2)
    assert r["choices"][0]["logprobs"] is None  # top_logprobs needs logprobs=true


def test_usage_with_n_counts_the_prompt_once_and_every_choice(client):
    r = post(client, "completions", prompt=[5, 6, 7], max_tokens=4, n=3, seed=1, **EXACT)
    assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}
    r = post(client, "completions", prompt=[[5, 6, 7], [8, 9]], max_tokens=2, n=2, seed=1, **EXACT)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}


def test_valid_top_p_and_top_k_shape_the_samples(client):
    """top_k=1 is greedy whatever the seed; a tight top_p is too when one token is likely."""
    base = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 1.0, **EXACT}
    greedy_text = post(client, "completions", **base | {"temperature": 0})["choices"][0]["text"]
    texts = {
        post(client, "completions", **base, top_k=1, seed=s)["choices"][0]["text"] for s in range(4)
    }
    assert texts == {greedy_text}
    texts = {
        post(client, "completions", **base, top_p=1e-6, seed=s)["choices"][0]["text"]
        for s in range(4)
    }
    assert texts == {greedy_text}
    free = {post(client, "completions", **base, seed=s)["choices"][0]["text"] for s in range(4)}
    assert len(free) > 1  # without them the seeds do differ
