"""LoRA adapters over the OpenAI API: --lora-modules, `model` picks the adapter, /v1/models
lists them, unknown names are 404 and a bad adapter stops the server at start."""

from __future__ import annotations

import argparse
import subprocess
import sys

import httpx
import openai
import pytest
from helpers import make_hf_checkpoint, make_peft_adapter
from test_server import Server

from ostinato import LLM, LoRARequest, SamplingParams
from ostinato.server.args import lora_module

ENGINE = ["--device", "cpu", "--max-model-len", "256", "--max-lora-rank", "16"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    base = make_hf_checkpoint("llama", root / "base")
    adapters = {name: make_peft_adapter(base, root / name, seed=i) for i, name in enumerate("ab")}
    return base, adapters


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    base, adapters = models
    modules = [f"{name}={path}" for name, path in adapters.items()]
    flags = ["--model", str(base), *ENGINE, "--served-model-name", "base", "--lora-modules"]
    srv = Server([*flags, *modules], tmp_path_factory.mktemp("log") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_models_lists_the_base_model_then_its_adapters(client, models):
    cards = client.models.list().data
    assert [m.id for m in cards] == ["base", "a", "b"]
    assert [getattr(m, "parent", None) for m in cards] == [None, "base", "base"]
    assert cards[1].root == str(models[1]["a"])


def test_model_field_picks_the_adapter(client, models):
    base, adapters = models
    prompts = ["Hello world", "The quick brown fox"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(base), device="cpu", max_model_len=256, enable_lora=True, max_lora_rank=16)
    for model in ("base", "a", "b"):
        lora = None if model == "base" else LoRARequest(model, str(adapters[model]))
        want = [o.text for o in llm.generate(prompts, params, lora_request=lora, use_tqdm=False)]
        r = client.completions.create(
            model=model,
            prompt=prompts,
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want, model
    chat = client.chat.completions.create(
        model="b", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert chat.model == "b" and chat.choices[0].message.content is not None


def test_unknown_adapter_is_404(client, server):
    with pytest.raises(openai.NotFoundError, match="'a', 'b'"):
        client.completions.create(model="c", prompt="Hi", max_tokens=2)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_bad_lora_module_stops_the_server_at_start(models):
    base, _ = models
    command = [sys.executable, "-m", "ostinato.server", "--model", str(base), *ENGINE]
    done = subprocess.run(
        [*command, "--lora-modules", "x=/nowhere"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "LoRA adapter 'x' (/nowhere)" in done.stderr, done.stderr


def test_lora_modules_are_name_equals_path():
    assert lora_module("sql=/a=b") == ("sql", "/a=b")
    for bad in ("no-equals", "=/path", "name="):
        with pytest.raises(argparse.ArgumentTypeError, match="expected NAME=PATH"):
            lora_module(bad)
