"""Greedy tokens of ostinato equal Hugging Face generate on the same random checkpoints."""

import pytest
from helpers import make_hf_checkpoint
from oracle import hf_greedy, hf_model, oracle_prompts, run_ostinato

MAX_NEW = 12


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_tokens_equal_transformers(arch, tmp_path):
    path = make_hf_checkpoint(arch, tmp_path / arch)
    prompts = oracle_prompts(300)
    llm, ours = run_ostinato(path, prompts, MAX_NEW, device="cpu", dtype="float32")
    assert ours == hf_greedy(hf_model(path), prompts, MAX_NEW)
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] >= 32  # the shared 40-token prefix: two full blocks
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_text_prompts_and_detokenized_text_match_transformers(tmp_path):
    path = make_hf_checkpoint("qwen3", tmp_path / "q")
    model = hf_model(path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    prompts = ["Hello world! Hello there", "The quick brown fox"]
    llm, _ = run_ostinato(path, [[5]], 1, device="cpu", dtype="float32")
    from ostinato import SamplingParams

    outs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), use_tqdm=False
    )
    expected = hf_greedy(model, [tok.encode(p) for p in prompts], MAX_NEW)
    assert [o.token_ids for o in outs] == expected
    assert [o.text for o in outs] == [tok.decode(e, skip_special_tokens=True) for e in expected]


def test_preemption_gives_the_same_tokens(tmp_path):
    path = make_hf_checkpoint("llama", tmp_path / "l")
    prompts = oracle_prompts(300, seed=1)
    _, roomy = run_ostinato(path, prompts, MAX_NEW, device="cpu", dtype="float32")
    llm, tight = run_ostinato(
        path, prompts, MAX_NEW, device="cpu", dtype="float32", num_kv_blocks=12, max_model_len=160
    )
    assert llm.engine.scheduler.num_preemptions > 0
    assert tight == roomy
