"""Speculative decoding through the whole engine: greedy output equal to decoding without it
(tiny, whose greedy output loops, and a saved random Llama, whose output does not), with
chunked prefill and several requests; stops, lengths, logprobs, streaming and the prefix cache
exactly as without it."""

import random
from collections import Counter

import pytest
import spec_workloads as workloads
from helpers import make_hf_checkpoint

from ostinato import LLM, SamplingParams
from ostinato.cli import main
from ostinato.config import EngineConfig

SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 4}
TINY = {"device": "cpu", "max_model_len": 96, "max_num_batched_tokens": 24, "max_num_seqs": 6}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny", **TINY), LLM("tiny", **TINY, **SPEC)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = str(make_hf_checkpoint("llama", tmp_path_factory.mktemp("llama")))
    kw = {"device": "cpu", "max_num_batched_tokens": 32, "max_num_seqs": 4}
    return LLM(path, **kw), LLM(path, **kw, **SPEC, ngram_max=3)


def generate(llm: LLM, prompts, params=GREEDY):
    return llm.generate(prompts, params, use_tqdm=False)


def same(outs_a, outs_b) -> None:
    for a, b in zip(outs_a, outs_b, strict=True):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)


def mixed_prompts(vocab: int, seed: int) -> list[list[int]]:
    """Repetitive prompts (long spans repeated) and random ones of very different lengths:
    several are chunked at 24-32 tokens a step, while others decode."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(2, vocab) for _ in range(n)]
    span = ids(9)
    return [span * 5, ids(3), ids(40), span * 2 + ids(4) + span, [7], ids(17) * 2]


def test_tiny_greedy_is_unchanged_and_mostly_accepted(tiny):
    base, spec = tiny
    prompts = mixed_prompts(256, 0) + ["The quick brown fox", "abcabcabcabc"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(8)
    ]
    same(generate(base, prompts, params), generate(spec, prompts, params))
    stats = spec.stats()
    assert stats["spec_draft_tokens"] > 100
    assert stats["spec_acceptance_rate"] > 0.8  # tiny's greedy output loops
    assert stats["spec_accepted_tokens"] == round(
        stats["spec_acceptance_rate"] * stats["spec_draft_tokens"]
    )
    steps = lambda llm: sum(llm.graph_report()["steps"].values())
    assert steps(spec) < steps(base) / 2


def test_llama_greedy_is_unchanged_on_repetitive_and_random_prompts(llama):
    base, spec = llama
    prompts = mixed_prompts(300, 1)
    same(generate(base, prompts), generate(spec, prompts))
    stats = spec.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["spec_acceptance_rate"] < 0.8  # its output does not loop


def test_stop_strings_stop_ids_and_max_tokens_cut_exactly(llama):
    base, spec = llama
    prompt = mixed_prompts(300, 2)[0]
    full = generate(base, [prompt])[0]
    text = full.text
    at = next(i for i in range(len(text) // 3, len(text)) if text[i : i + 2].isascii())
    stop_text = text[at : at + 2]
    stop_id = full.token_ids[9]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=24, stop=[stop_text]),
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id]),
        *(SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 2, 3, 7)),
    ]
    want = generate(base, [prompt] * len(cases), cases)
    got = generate(spec, [prompt] * len(cases), cases)
    same(want, got)
    assert got[0].finish_reason == got[1].finish_reason == "stop"
    assert stop_text not in got[0].text and got[1].token_ids[-1] == stop_id
    assert [len(o.token_ids) for o in got[2:]] == [1, 2, 3, 7]


def test_stops_inside_a_run_of_accepted_drafts(tiny):
    base, spec = tiny
    prompt = "The quick brown fox"  # tiny answers one letter, over and over
    letter = generate(base, [prompt])[0].text[0]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=40, stop=[letter * 7]),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    ]
    got = generate(spec, [prompt] * 2, cases)
    same(generate(base, [prompt] * 2, cases), got)
    assert got[0].text == "" and len(got[0].token_ids) == 7  # the stop string is cut off
    assert len(got[1].token_ids) == 6


def test_max_model_len_cuts_exactly(tiny):
    base, spec = tiny
    prompt = [65, 66, 67] * 30  # 90 of the 96 positions
    want, got = generate(base, [prompt]), generate(spec, [prompt])
    same(want, got)
    assert got[0].finish_reason == "length" and len(got[0].token_ids) == 6


def test_streaming_delivers_every_token_once(tiny):
    _, spec = tiny
    engine = spec.engine
    rid = engine.add_request([70, 71, 72] * 4, SamplingParams(temperature=0.0, max_tokens=17))
    streamed, sizes = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            streamed += out.new_token_ids
            sizes.append(len(out.new_token_ids))
            assert out.token_ids == streamed
    assert out.finished and len(streamed) == 17 and max(sizes) > 1


def test_logprobs_match_decoding_without_drafts(llama):
    base, spec = llama
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    prompts = mixed_prompts(300, 3)[:3]
    for want, got in zip(
        generate(base, prompts, params), generate(spec, prompts, params), strict=True
    ):
        assert got.token_ids == want.token_ids and len(got.logprobs) == 12
        for a, b in zip(want.logprobs, got.logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_prefix_cache_holds_only_verified_tokens(llama):
    """A follow-up prompt reuses the blocks a speculating request filled: its output must be
    what a fresh engine without speculation gives (rejected drafts' KV is never cached)."""
    base, spec = llama
    first = mixed_prompts(300, 4)[2]
    out = generate(spec, [first])[0]
    follow_up = first + out.token_ids[:20] + [5, 6]
    hits = spec.stats()["prefix_cache_hits"]
    got = generate(spec, [follow_up])[0]
    assert spec.stats()["prefix_cache_hits"] - hits >= 48  # prompt and output blocks
    assert got.token_ids == generate(base, [follow_up])[0].token_ids


def test_seeded_sampling_is_reproducible_and_bounded(tiny):
    _, spec = tiny
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=9 + i) for i in range(4)
    ]
    first = generate(spec, ["abcabcabc"] * 4, params)
    again = generate(spec, ["abcabcabc"] * 4, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert spec.stats()["spec_accepted_tokens"] > 0
    assert all(len(o.token_ids) <= 9 + i for i, o in enumerate(first))
    engine = spec.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(llama):
    base, spec = llama
    prompts = mixed_prompts(300, 7)
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=12) for i in range(len(prompts))]
    drafted = spec.stats()["spec_draft_tokens"]
    same(generate(spec, prompts, params), generate(base, prompts, params))
    assert spec.stats()["spec_draft_tokens"] > drafted


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("workload", ["mixed", "sampling"])
def test_the_gpu_tests_workloads_accept_drafts_in_uniform_verify_batches(arch, workload, tmp_path):
    """tests/gpu/test_spec_graphs.py's workloads on the CPU: decode batches mostly verify
    1 + k tokens per request (there, they replay the FULL graphs of that query length), and
    the greedy one accepts drafts. A scheduling rule that stopped speculating in them would
    leave those GPU tests checking plain decoding; the margins allow for the GPU's greedy
    tokens parting from these at a near tie."""
    path = str(make_hf_checkpoint(arch, tmp_path))
    llm = LLM(path, device="cpu", **workloads.ENGINE, **workloads.SPEC)
    if workload == "mixed":
        repeating = workloads.self_repeating_tokens(LLM(path, device="cpu", **workloads.ENGINE))
        run = lambda: workloads.mixed_workload(llm, repeating)
    else:
        run = lambda: workloads.sampling_workload(llm)
    batches = Counter()  # uniform decode batches by query length; None: the others
    schedule = llm.engine.scheduler.schedule

    def counting_schedule():
        batch = schedule()
        if batch is not None:
            batches[batch.uniform_query_len] += 1
        return batch

    llm.engine.scheduler.schedule = counting_schedule
    run()
    verify = 1 + workloads.K
    assert batches[verify] >= 10 and batches[verify] > 2 * batches[1], batches
    if workload == "mixed":  # sampled tokens rarely equal the drafts
        assert llm.stats()["spec_accepted_tokens"] >= 100, llm.stats()


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (
            {"speculative_method": "medusa", "num_speculative_tokens": 2},
            "unknown speculative_method",
        ),
        ({"speculative_method": "ngram"}, "num_speculative_tokens >= 1"),
        ({"num_speculative_tokens": 3}, "needs a speculative_method"),
        ({**SPEC, "ngram_min": 3, "ngram_max": 2}, "ngram_min <= ngram_max"),
        ({**SPEC, "max_num_batched_tokens": 4}, "max_num_batched_tokens"),
    ],
)
def test_bad_speculative_config(kwargs, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(device="cpu", **kwargs)


def test_cli_flags(capsys):
    argv = ["generate", "--device", "cpu", "--max-tokens", "6", "abcabcabc"]
    assert main([*argv, "--speculative-method", "ngram", "--num-speculative-tokens", "3"]) == 0
    assert "6 tokens" in capsys.readouterr().out
    assert main(["generate", "--device", "cpu", "--num-speculative-tokens", "3"]) == 2
    assert "speculative_method" in capsys.readouterr().err


def test_two_pipeline_stages_speculate_as_one_process(tiny):
    """Drafts travel in the StepInput; the last stage verifies them, with batches in flight."""
    base, _ = tiny
    prompts = mixed_prompts(256, 5)
    llm = LLM("tiny", **TINY, **SPEC, pipeline_parallel_size=2)
    try:
        same(generate(base, prompts), generate(llm, prompts))
        assert llm.stats()["spec_accepted_tokens"] > 0
    finally:
        llm.engine.shutdown()
