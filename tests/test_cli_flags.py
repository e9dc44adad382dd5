"""Every `ostinato generate` flag through the real entry point (cli.main): the sampling flags
reach the request, the engine flags reach the engine and change what it does."""

from __future__ import annotations

import json

import pytest
from helpers import make_hf_checkpoint, make_peft_adapter

import ostinato
from ostinato import LLM, LoRARequest, SamplingParams
from ostinato.cli import main

BASE = ["--device", "cpu", "--max-model-len", "128", "--num-kv-blocks", "32"]


@pytest.fixture
def spy(monkeypatch):
    """Records each LLM that cli.main builds and each generate call (prompts, params, lora)."""
    seen = {"llms": [], "calls": []}

    class Spy(LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen["llms"].append(self)

        def generate(self, prompts, sampling_params=None, use_tqdm=True, lora_request=None):
            outs = super().generate(prompts, sampling_params, use_tqdm, lora_request)
            seen["calls"].append((prompts, sampling_params, lora_request, outs))
            return outs

    monkeypatch.setattr(ostinato, "LLM", Spy)
    return seen


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint("qwen3", tmp_path_factory.mktemp("ckpt") / "qwen3")


def test_sampling_flags_reach_the_request_and_the_printout(spy, capsys, checkpoint):
    argv = ["generate", "The quick", "--model", str(checkpoint), *BASE, "--max-tokens", "5",
            "--temperature", "0.7", "--top-p", "0.8", "--top-k", "7", "--sampling-seed", "3",
            "--stop", "zz", "--stop", "q!", "--ignore-eos"]  # fmt: skip
    assert main(argv) == 0
    ((prompts, params, lora, outs),) = spy["calls"]
    assert prompts == ["The quick"] and lora is None
    assert params == SamplingParams(temperature=0.7, top_p=0.8, top_k=7, seed=3, max_tokens=5,
                                    stop=["zz", "q!"], ignore_eos=True)  # fmt: skip
    out = outs[0]
    printed = capsys.readouterr().out
    header = f"--- 'The quick' ({len(out.token_ids)} tokens, {out.finish_reason})"
    assert printed == f"{header}\nThe quick{out.text}\n"
    assert out.text  # the BPE tokenizer decodes the sample to text: the print shows it
    # the same request through the API samples the same tokens (the seed is honoured)
    again = spy["llms"][0].generate(["The quick"], params, use_tqdm=False)[0]
    assert again.token_ids == out.token_ids


def test_greedy_default_and_the_two_example_prompts(spy, capsys):
    assert main(["generate", *BASE, "--max-tokens", "3"]) == 0
    ((prompts, params, _, outs),) = spy["calls"]
    assert prompts == ["The capital of France is", "Once upon a time"]
    assert params.greedy and params.top_p == 1.0 and params.top_k == -1 and params.seed is None
    assert params.stop == [] and not params.ignore_eos and params.max_tokens == 3
    assert capsys.readouterr().out.count("--- ") == 2


def test_lora_flag_runs_the_prompts_through_the_adapter(spy, capsys, checkpoint, tmp_path):
    adapter = make_peft_adapter(checkpoint, tmp_path / "adapter")
    argv = ["generate", "Hello world", "--model", str(checkpoint), *BASE, "--max-tokens", "6",
            "--ignore-eos", "--lora", f"mine={adapter}", "--max-loras", "2"]  # fmt: skip
    assert main(argv) == 0
    ((_, _, lora, outs),) = spy["calls"]
    assert lora == LoRARequest("mine", str(adapter))
    llm = spy["llms"][0]
    assert llm.engine.config.enable_lora and llm.engine.config.max_loras == 2
    assert llm.engine.lora.max_loras == 2
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    base = llm.generate(["Hello world"], params, use_tqdm=False)[0]
    assert outs[0].token_ids != base.token_ids  # the adapter changed the tokens


def engine_of(spy, argv: list[str]) -> LLM:
    assert main(["generate", "hello there, general", "--max-tokens", "2", *argv]) == 0
    return spy["llms"][-1]


def test_kv_cache_flags_size_the_cache(spy):
    llm = engine_of(spy, ["--device", "cpu", "--max-model-len", "64", "--num-kv-blocks", "9"])
    assert llm.engine.block_manager.num_blocks == 9
    c = llm.engine.runner.hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    block_bytes = 2 * 16 * c.num_key_value_heads * head_dim * c.num_hidden_layers * 4  # fp32
    memory = ["--device", "cpu", "--max-model-len", "64", "--kv-cache-memory"]
    llm = engine_of(spy, [*memory, str(10 * block_bytes + 5)])
    assert llm.engine.block_manager.num_blocks == 10


def test_max_num_batched_tokens_chunks_the_prefill(spy):
    prompt = list(range(3, 63))  # 60 tokens: 3 chunks of 24, then one decode
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    steps = {}
    for budget in ("24", "8192"):
        llm = engine_of(spy, [*BASE, "--max-num-batched-tokens", budget])
        before = llm.graph_report()["steps"]["none"]
        llm.generate([prompt], params, use_tqdm=False)
        steps[budget] = llm.graph_report()["steps"]["none"] - before
    assert steps == {"24": 4, "8192": 2}


def test_no_prefix_caching_on_cpu(spy):
    prompt = list(range(3, 40))  # two full blocks of 16 can be reused
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for flags, cached in (([], 32), (["--no-prefix-caching"], 0)):
        llm = engine_of(spy, [*BASE, *flags])
        llm.generate([prompt], params, use_tqdm=False)
        assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == cached


def test_ngram_flags_reach_the_proposer_and_keep_the_tokens(spy):
    flags = [*BASE, "--speculative-method", "ngram", "--num-speculative-tokens", "3",
             "--ngram-min", "2", "--ngram-max", "3", "--max-tokens", "12"]  # fmt: skip
    llm = engine_of(spy, flags)
    proposer = llm.engine.scheduler.proposer
    assert (proposer.k, proposer.ngram_min, proposer.ngram_max) == (3, 2, 3)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    plain = LLM("tiny", device="cpu", max_model_len=128, num_kv_blocks=32)
    assert spec == plain.generate([prompt], params, use_tqdm=False)[0].token_ids
    assert llm.stats()["spec_draft_tokens"] > 0


def test_distributed_timeout_reaches_the_config(spy):
    llm = engine_of(spy, [*BASE, "--distributed-timeout", "7.5"])
    assert llm.engine.config.distributed_timeout == 7.5


@pytest.mark.parametrize(
    ("flags", "check"),
    [
        (["--max-capture-size", "64"], lambda r: r["capture_sizes"]["piecewise"][-1] == 64),
        (
            ["--enforce-eager"],
            lambda r: (
                r["cuda_graph_mode"] == "none" and r["decisions"][0]["rule"] == "enforce_eager"
            ),
        ),  # fmt: skip
        (["--check-graphs", "3"], lambda r: r["config"]["check_graphs"] == 3),
        (["--distributed-timeout", "9"], lambda r: r["config"]["distributed_timeout"] == 9.0),
        (
            ["--full-prefill-max-tokens", "0"],
            lambda r: r["capture_sizes"]["full_prefill"]["num_tokens"] == [],
        ),
        (
            ["--full-prefill-min-tokens", "256", "--full-prefill-max-tokens", "1024"],
            lambda r: r["capture_sizes"]["full_prefill"]["num_tokens"][::12] == [256, 1024],
        ),
    ],
)
def test_graph_flags_through_explain(capsys, flags, check):
    """explain resolves the config as generate and serve do, without weights, on a CUDA config."""
    assert main(["explain", "--device", "cuda", "--json", *flags]) == 0
    assert check(json.loads(capsys.readouterr().out))
    assert main(["explain", "--device", "cuda", "--json"]) == 0
    assert not check(json.loads(capsys.readouterr().out))  # the default differs


def test_check_graphs_and_enforce_eager_reach_a_running_engine(spy):
    llm = engine_of(spy, [*BASE, "--check-graphs", "2", "--enforce-eager"])
    assert llm.engine.config.check_graphs == 2 and llm.engine.config.enforce_eager


@pytest.mark.parametrize("block_size", [8, 32])
def test_a_block_size_other_than_16_gives_the_same_tokens(block_size):
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    kw = {"device": "cpu", "max_model_len": 128, "max_num_batched_tokens": 48}
    reference = LLM("tiny", num_kv_blocks=40, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM("tiny", block_size=block_size, num_kv_blocks=640 // block_size, **kw)
    assert llm.engine.runner.block_size == block_size
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    again = llm.generate(prompts[1:2], params, use_tqdm=False)[0]  # from the prefix cache
    # whole blocks, less the last prompt token, which must be computed to sample
    assert again.num_cached_tokens == (40 - 1) // block_size * block_size
    assert again.token_ids == reference[1].token_ids
