"""The engine on the tiny model: bad input, sampling, stopping, aborts, the CLI."""

import pytest
import torch

from ostinato import LLM, SamplingParams
from ostinato.cli import main
from ostinato.config import EngineConfig
from ostinato.engine.engine import LLMEngine
from ostinato.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", max_num_batched_tokens=64, max_model_len=256)


def test_generate_returns_outputs_in_input_order(llm):
    prompts = ["hello there", [1, 2, 3, 4], "a much longer prompt " * 8]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [5, 5, 5]
    assert [o.finish_reason for o in outs] == ["length"] * 3
    alone = llm.generate(prompts[1], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert alone[0].token_ids == outs[1].token_ids  # batching does not change greedy tokens


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "empty"),
        ([], "empty"),
        ([1, 2, 10**9], "outside the vocabulary"),
        ([-1], "outside the vocabulary"),
        (list(range(1, 300)), "max_model_len"),
    ],
)
def test_bad_prompt_is_rejected_up_front(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine prompt", prompt], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()  # the good prompt was not queued either
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"model": "/no/such/dir"}, "does not exist"),
        ({"model": "random:nope"}, "preset"),
        ({"dtype": "float13"}, "dtype"),
        ({"cuda_graph_mode": "sometimes"}, "cuda_graph_mode"),
        ({"cuda_graph_capture": "later"}, "cuda_graph_capture"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ],
)
def test_bad_engine_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(**{"model": "tiny", "device": "cpu", **kwargs})


def test_model_dir_without_config(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path), device="cpu")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}'
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path), device="cpu")


def test_seeded_sampling_is_reproducible_and_differs_by_seed(llm):
    def sample(seed):
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=seed, max_tokens=8)
        return llm.generate(["once upon"], params)[0].token_ids

    assert sample(1) == sample(1)
    assert sample(1) != sample(2) or sample(3) != sample(1)


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(["abc"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    top1 = llm.generate(
        ["abc"], SamplingParams(temperature=0.9, top_k=1, max_tokens=6, ignore_eos=True)
    )
    assert greedy[0].token_ids == top1[0].token_ids


def test_stop_token_and_stop_string(llm, tmp_path):
    base = llm.generate(["xyz"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    stop_id = base.token_ids[3]
    first = base.token_ids.index(stop_id)
    out = llm.generate(
        ["xyz"], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_id])
    )
    assert out[0].token_ids == base.token_ids[: first + 1] and out[0].finish_reason == "stop"
    # tiny's byte tokenizer decodes its greedy tokens to little text: stop strings need a BPE one
    from helpers import make_hf_checkpoint

    bpe = LLM(str(make_hf_checkpoint("qwen3", tmp_path / "q")), device="cpu", max_model_len=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = bpe.generate(["The quick"], greedy)[0]
    assert len(full.text) >= 6, full.text
    stop = full.text[3:5]
    at = full.text.find(stop)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=["#@!", stop])
    out = bpe.generate(["The quick"], params)[0]
    assert out.finish_reason == "stop" and out.text == full.text[:at]
    assert len(out.token_ids) < len(full.token_ids)  # generation ended at the stop string
    assert out.token_ids == full.token_ids[: len(out.token_ids)]


def test_logprobs(llm):
    out = llm.generate(
        ["hi"], SamplingParams(temperature=0.0, max_tokens=3, logprobs=4, ignore_eos=True)
    )[0]
    assert len(out.logprobs) == 3
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and len(entry) in (4, 5)
        assert entry[token] == max(entry.values())  # greedy picks the top logprob
        assert all(v <= 0 for v in entry.values())


def test_abort_frees_blocks(llm):
    engine = llm.engine
    rid = engine.add_request("abort me please", SamplingParams(max_tokens=50, ignore_eos=True))
    other = engine.add_request(
        "keep me", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    engine.step()
    engine.abort_request(rid)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert {o.request_id for o in outs if o.finished} == {other}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_cpu_engine_runs_without_graphs(llm):
    report = llm.graph_report()
    assert report["cuda_graph_mode"] == "none"
    assert any("CUDA device" in d["reason"] for d in report["decisions"])


def test_cli_generate(capsys):
    assert main(["generate", "hi", "--max-tokens", "4", "--device", "cpu"]) == 0
    params = SamplingParams(temperature=0.0, max_tokens=4)
    out = LLM("tiny", device="cpu", max_model_len=64).generate(["hi"], params)[0]
    header = f"--- 'hi' ({len(out.token_ids)} tokens, {out.finish_reason})"
    assert capsys.readouterr().out == f"{header}\nhi{out.text}\n"
    assert len(out.token_ids) == 4  # the header's count is the generated tokens, not the prompt's


def test_cli_bad_input_exits_2_without_traceback(capsys):
    assert main(["generate", "hi", "--model", "/no/such/dir", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err


def test_config_defaults_on_cpu():
    config = EngineConfig(device="cpu")
    assert config.dtype == "float32" and config.attention_backend == "torch"


def test_cpu_report_counts_eager_steps():
    llm = LLM("tiny", device="cpu", cuda_graph_mode="piecewise")
    llm.generate(["count my steps"], SamplingParams(max_tokens=3, ignore_eos=True))
    report = llm.graph_report()
    assert report["requested_mode"] == "piecewise" and report["cuda_graph_mode"] == "none"
    assert report["steps"]["none"] == 3 and report["steps"]["full"] == 0
    assert report["captured"] == {"full": [], "piecewise": []}


def lm_head_rows(monkeypatch, max_num_seqs: int) -> tuple[LLM, list[int]]:
    """An engine of at most max_num_seqs requests, and the rows its LM head runs over, call
    by call (appended as they come)."""
    llm = LLM("tiny", device="cpu", max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
              max_model_len=512)  # fmt: skip
    model, seen = llm.engine.runner.model, []
    compute_logits = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: seen.append(len(h)) or compute_logits(h))
    return llm, seen


def test_the_lm_head_sees_only_the_row_counts_start_up_warms(monkeypatch):
    """cuBLAS loads a kernel at a row count's first use: the LM head runs over a few padded
    counts, and start-up's tail warm-up runs each of them once."""
    llm, seen = lm_head_rows(monkeypatch, 24)
    llm.engine.runner._warm_up_tail()
    warmed, seen[:] = set(seen), []
    params = [SamplingParams(max_tokens=1 + i % 9, ignore_eos=True) for i in range(23)]
    scored = SamplingParams(max_tokens=2, prompt_logprobs=0)
    llm.generate([[7 + i] * (2 + i) for i in range(23)] + [[3] * 300], [*params, scored])
    assert len(set(seen)) > 4 and set(seen) <= warmed, sorted(set(seen) - warmed)
    assert len(warmed) == 16  # 1, 2, 3, 4, 6, 8, ..., 192, 256: not every count up to 256


def test_the_tail_warm_up_takes_both_top_k_and_nucleus_masks(llm, monkeypatch):
    """A batch whose filters all have a top_k ranks its candidates (topk); one with a top-p
    alone takes the nucleus mask (kernels/nucleus.py): start-up takes both, so neither loads
    kernels mid-serving."""
    from ostinato.runner import sampler

    taken = []
    topk, top_p_mask = torch.Tensor.topk, sampler.top_p_mask
    monkeypatch.setattr(torch.Tensor, "topk", lambda *a, **k: taken.append("topk") or topk(*a, **k))
    monkeypatch.setattr(sampler, "top_p_mask", lambda *a: taken.append("nucleus") or top_p_mask(*a))
    llm.engine.runner._warm_up_tail()
    assert {"topk", "nucleus"} <= set(taken)


def test_the_kv_sizing_step_scores_the_most_rows_the_lm_head_sees(monkeypatch):
    """The KV sizing's peak step takes the LM head (and a float32 softmax) over the most rows
    it sees in one pass: with 4 requests, a chunk of 256 scored prompt positions, not the 4
    sampled rows, so prompt logprobs never need more memory than the KV sizing left."""
    from ostinato.runner.model_runner import PROMPT_LOGITS_ROWS, head_rows

    llm, seen = lm_head_rows(monkeypatch, 4)
    llm.engine.runner._run_dummy()
    assert seen == [head_rows(PROMPT_LOGITS_ROWS)]
    seen.clear()
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0)
    llm.generate([[5] * 400], scored, use_tqdm=False)
    assert max(seen) == head_rows(PROMPT_LOGITS_ROWS)


def test_padded_lm_head_rows_leave_each_requests_logits_alone(llm):
    """The padding rows hold whatever earlier steps left; the real rows' logits are those of
    the LM head over exactly the sampled positions."""
    runner = llm.engine.runner
    hidden = torch.randn(40, runner.hf_config.hidden_size)
    runner.head_input.normal_(std=1e3)
    runner.buffers.device["logits_indices"][:11] = torch.arange(39, 17, -2)
    want = runner.model.compute_logits(hidden[torch.arange(39, 17, -2)])
    torch.testing.assert_close(runner._logits(hidden, 0, 11), want)
    torch.testing.assert_close(runner._logits(hidden, 2, 11), want[2:])


def test_max_model_len_defaults_to_the_model_and_rejects_more(tmp_path):
    from helpers import make_hf_checkpoint

    path = make_hf_checkpoint("qwen3", tmp_path / "q", max_position_embeddings=96)
    assert LLM(str(path), device="cpu").engine.config.max_model_len == 96
    assert LLM("tiny", device="cpu").engine.config.max_model_len == 4096
    with pytest.raises(ValueError, match="max_position_embeddings=96"):
        LLM(str(path), device="cpu", max_model_len=128)


def test_logprobs_above_the_vocabulary_is_rejected_up_front(llm):
    good, bad = SamplingParams(max_tokens=2), SamplingParams(logprobs=10**6)
    with pytest.raises(ValueError, match="prompt 1: logprobs"):
        llm.generate(["a", "b"], [good, bad])
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
    ],
)
def test_non_finite_temperature_and_huge_seed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_tiny_temperature_is_greedy(llm):
    greedy = llm.generate(["abc"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    tiny = llm.generate(["abc"], SamplingParams(temperature=1e-40, max_tokens=6, ignore_eos=True))
    assert tiny[0].token_ids == greedy[0].token_ids


def test_a_failing_step_leaves_no_request_behind(llm, monkeypatch):
    def boom(step):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(llm.engine.runner, "launch", boom)
    with pytest.raises(RuntimeError, match="fell over"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=3))
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests() and not llm.engine.scheduler.in_flight
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert (
        len(llm.generate(["again"], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids)
        == 3
    )


def test_outputs_are_snapshots_that_later_steps_leave_alone(llm):
    engine = llm.engine
    engine.add_request("snap", SamplingParams(max_tokens=4, logprobs=2, ignore_eos=True))
    first = []
    while not first:
        first = engine.step()
    tokens, logprobs = list(first[0].token_ids), list(first[0].logprobs)
    while engine.has_unfinished_requests():
        engine.step()
    assert first[0].token_ids == tokens and first[0].logprobs == logprobs
    assert len(tokens) == 1 and len(logprobs) == 1


# ---- stopping, token by token -------------------------------------------------------------
def append_step(llm, params: SamplingParams, tokens: list[int]):
    """A new request of prompt [1, 2, 3] and the output of one step that appends `tokens` (a
    sampled token after accepted drafts, as speculative decoding gives several per step)."""
    engine = llm.engine
    rid = engine.add_request([1, 2, 3], params)
    return engine._append_tokens(engine.requests[rid], tokens, None)


def test_a_step_s_tokens_stop_at_the_first_that_ends_the_request(llm):
    llm.generate(["warm"], SamplingParams(max_tokens=2))  # the token count starts above 0
    before = llm.engine.generation_tokens_total
    params = SamplingParams(max_tokens=10, stop_token_ids=[66], prompt_logprobs=1)
    out = append_step(llm, params, [65, 66, 67])
    assert out.finished and out.finish_reason == "stop"
    assert out.token_ids == out.new_token_ids == [65, 66] and out.text == "AB"
    assert out.prompt_token_ids == (1, 2, 3) and out.num_cached_tokens == 0
    assert out.prompt_logprobs == [None, None, None]  # none computed by this step
    assert llm.engine.generation_tokens_total == before + 2
    assert out.request_id not in llm.engine.requests
    assert out.request_id not in llm.engine.detokenizers  # nothing of it stays behind
    length = append_step(llm, SamplingParams(max_tokens=2), [65, 66, 67])
    assert (length.token_ids, length.finish_reason) == ([65, 66], "length")
    going = append_step(llm, SamplingParams(max_tokens=5), [65, 66])
    assert not going.finished and going.finish_reason is None and going.new_token_ids == [65, 66]
    llm.engine.abort_request(going.request_id)


def test_stop_tokens_count_from_min_tokens_on(llm):
    params = SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[66])
    out = append_step(llm, params, [66, 66, 67])  # the first is too early, the second stops
    assert out.token_ids == [66, 66] and out.finish_reason == "stop"


def test_max_model_len_ends_a_request_at_exactly_that_length():
    llm = LLM("tiny", device="cpu", max_num_batched_tokens=64, max_model_len=8)
    out = llm.generate([[1] * 6], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 2


def test_the_end_flushes_a_character_cut_in_half(llm):
    out = append_step(llm, SamplingParams(max_tokens=2), [65, 0xC3])  # "A", half of "é"
    assert out.finish_reason == "length" and out.text == "A\ufffd"


def test_a_finished_grammar_ends_the_request(llm):
    params = SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=["yes"])
    )
    out = llm.generate(["Answer:"], params)[0]
    assert (out.text, out.finish_reason) == ("yes", "stop")
    assert out.token_ids == list(b"yes")  # nothing after the grammar's end, not even EOS


def test_an_engine_without_detokenizers_gives_no_text():
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", max_model_len=64), detokenize=False)
    rid = engine.add_request([1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    final = [o for o in outs if o.finished]
    assert [(o.request_id, len(o.token_ids), o.text) for o in final] == [(rid, 3, "")]


def test_outputs_count_the_prompt_tokens_the_prefix_cache_served(llm):
    prompt = [5] * 40  # two full blocks of 16 and a rest
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    assert llm.generate([prompt], params)[0].num_cached_tokens == 0
    assert llm.generate([prompt], params)[0].num_cached_tokens == 32
