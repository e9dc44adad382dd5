"""Sampling settings computed on the device: penalties, min_p, min_tokens, logit_bias,
stop_token_ids and prompt logprobs, against math written here (float64) and against
transformers, with async scheduling and chunked prefill."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_hf_checkpoint
from oracle import hf_model
from test_async_scheduling import assert_nothing_leaked

from ostinato import LLM, SamplingParams
from ostinato.runner import sampler as sampler_module
from ostinato.runner.logits_processors import process_logits
from ostinato.runner.sampler import Sampler
from ostinato.runner.step import SamplingRow, TokenHistory

VOCAB = 50


def reference(logits, prompt, output, rep, freq, pres):
    """Penalties as HF (repetition over prompt + output) and OpenAI (frequency, presence over
    the output) define them, one token at a time in float64."""
    out = logits.double().clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= freq * output.count(t) + pres
    return out


def row(params, prompt=(), output=(), pending=False, drafts=(), **kw):
    history = TokenHistory(tuple(prompt), tuple(output), pending) if params.penalized else None
    return SamplingRow("r", params, len(prompt) + len(output), tuple(drafts), history, **kw)


def test_penalties_match_the_reference_including_drafts_and_the_token_in_flight():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=g) * 3
    p1 = SamplingParams(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=-0.4)
    p2 = SamplingParams(frequency_penalty=1.3)
    rows = [
        row(p1, prompt=[1, 2, 3, 2], output=[4, 4, 9], drafts=[4, 7]),  # logits rows 0, 1, 2
        row(SamplingParams()),  # row 3: untouched
        row(p2, prompt=[5], output=[6, 6], pending=True),  # row 4: its input token is in flight
    ]
    owners = [rows[0]] * 3 + [rows[1], rows[2]]
    in_flight = torch.tensor([0, 0, 0, 0, 11])  # the input token of each logits row
    got = process_logits(logits, rows, owners, lambda: in_flight)
    want = [
        reference(logits[0], [1, 2, 3, 2], [4, 4, 9], 1.7, 0.6, -0.4),
        reference(logits[1], [1, 2, 3, 2], [4, 4, 9, 4], 1.7, 0.6, -0.4),
        reference(logits[2], [1, 2, 3, 2], [4, 4, 9, 4, 7], 1.7, 0.6, -0.4),
        logits[3].double(),
        reference(logits[4], [5], [6, 6, 11], 1.0, 1.3, 0.0),
    ]
    torch.testing.assert_close(got.double(), torch.stack(want), rtol=1e-6, atol=1e-6)


def test_nothing_asked_costs_nothing():
    logits = torch.randn(2, VOCAB)
    rows = [row(SamplingParams()), row(SamplingParams(temperature=0))]
    assert process_logits(logits, rows, rows, None) is logits  # no copy, no kernel


def test_min_tokens_bans_stop_ids_only_while_short_and_logit_bias_adds():
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 5.0  # EOS would win
    params = SamplingParams(temperature=0, min_tokens=2, logit_bias={3: 2.5, 8: -1.0})
    r = row(params, prompt=[1], drafts=[3, 3], banned=(7, 9), min_tokens_left=2)
    got = process_logits(logits, [r], [r] * 3, None)
    assert torch.isinf(got[:2, [7, 9]]).all() and got[2, 7] == 5.0  # the third row has 2 tokens
    assert got[0, 3] == 2.5 and got[0, 8] == -1.0 and got[2, 3] == 2.5
    assert Sampler()(logits, [r]).token_ids == [[3, 3, 7]]


def test_min_p_keeps_only_tokens_above_its_share_of_the_best():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    params = SamplingParams(temperature=1.0, min_p=0.5)
    seen = {
        Sampler()(probs.log(), [SamplingRow("r", params, i)]).token_ids[0][0] for i in range(200)
    }
    assert seen == {0, 1}  # 0.15 < 0.5 * 0.5


def test_min_p_masks_its_own_rows_only_and_one_keeps_the_best():
    """In a batch with a row that sets no min_p, that row keeps every token; min_p = 1 keeps
    the most likely token alone (a token at the floor is kept, not masked)."""
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3)
    rows = [SamplingRow("none", SamplingParams(temperature=1.0), 0),
            SamplingRow("half", SamplingParams(temperature=1.0, min_p=0.5), 0),
            SamplingRow("one", SamplingParams(temperature=1.0, min_p=1.0), 0)]  # fmt: skip
    kept = torch.isfinite(sampler_module._min_p(probs.log(), rows))
    assert kept.tolist() == [[True] * 4, [True, True, False, False], [True, False, False, False]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens must be in [0, max_tokens=8]"),
        ({"logit_bias": {3: 101}}, "logit_bias values must be in [-100, 100]"),
        ({"logit_bias": {-1: 1}}, "logit_bias keys must be token ids >= 0"),
        ({"stop_token_ids": [-2]}, "stop_token_ids must be token ids >= 0"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be >= 0"),
    ],
)
def test_bad_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny", device="cpu", max_model_len=256)


def greedy(llm, prompt, **kw):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw)
    return llm.generate([prompt], params, use_tqdm=False)[0].token_ids


def test_settings_change_greedy_output_as_they_should(tiny):
    base = greedy(tiny, "1, 2, 3,")
    assert len(set(base)) < len(base)  # random weights repeat themselves
    penalized = greedy(tiny, "1, 2, 3,", frequency_penalty=2.0)
    assert penalized != base and len(set(penalized)) == len(penalized)
    assert greedy(tiny, "1, 2, 3,", logit_bias={65: 100}) == [65] * 12
    stop = base[0]
    assert greedy(tiny, "1, 2, 3,", stop_token_ids=[stop])[:1] == [stop]
    late = tiny.generate(
        ["1, 2, 3,"],
        SamplingParams(temperature=0, max_tokens=12, min_tokens=4, stop_token_ids=[stop]),
        use_tqdm=False,
    )[0]
    assert stop not in late.token_ids[:4] and len(late.token_ids) >= 4


def engine_workload(llm):
    """Every setting at once, in chunked prefills and decodes of several requests."""
    prompts = ["1, 2, 3, 4, 5, 6, 7, 8,", "Once upon a time there was", "abcabcabc" * 5, "xyz"]
    params = [
        SamplingParams(temperature=0, max_tokens=20, frequency_penalty=1.5, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=20, presence_penalty=1.0,
                       repetition_penalty=1.3, min_p=0.05, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=20, repetition_penalty=2.0, min_tokens=5,
                       logit_bias={97: 3.0}, prompt_logprobs=0),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    ]  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.token_ids, o.finish_reason, o.prompt_logprobs) for o in outs]


def test_async_scheduling_and_chunking_change_nothing():
    kw = {"device": "cpu", "max_model_len": 256}
    want = engine_workload(LLM("tiny", async_scheduling=False, **kw))
    llm = LLM("tiny", async_scheduling=True, max_num_batched_tokens=16, max_num_seqs=3, **kw)
    got = engine_workload(llm)
    for (tokens, reason, prompt), (tokens_w, reason_w, prompt_w) in zip(got, want, strict=True):
        assert (tokens, reason) == (tokens_w, reason_w)
        assert (prompt is None) == (prompt_w is None)
        for entry, entry_w in zip(prompt or [], prompt_w or [], strict=True):
            assert (entry is None) == (entry_w is None)
            if entry is not None:
                assert entry.keys() == entry_w.keys()
                assert all(entry[t] == pytest.approx(entry_w[t], abs=1e-4) for t in entry)
    assert_nothing_leaked(llm)


def test_prompt_logprobs_equal_transformers_over_chunked_prefill(tmp_path):
    path = str(make_hf_checkpoint("qwen3", tmp_path / "qwen3"))
    prompt = [5, 17, 99, 3, 250, 42, 42, 8, 19, 77, 120, 6, 200, 31, 2, 64, 90, 11, 13]
    llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=8, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    llm.generate([prompt], params, use_tqdm=False)  # fills the prefix cache: it must not be used
    out = llm.generate([prompt, [7, 8, 9]], params, use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        want = ref[i - 1]
        assert entry[prompt[i]] == pytest.approx(want[prompt[i]].item(), abs=1e-4)
        top = want.topk(3).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= 4
        assert all(entry[t] == pytest.approx(want[t].item(), abs=1e-4) for t in entry)
    assert not math.isnan(out.prompt_logprobs[-1][prompt[-1]])


def test_engine_refuses_token_ids_outside_the_vocabulary(tiny):
    for field in ("stop_token_ids", "logit_bias"):
        value = [999] if field == "stop_token_ids" else {999: 1.0}
        with pytest.raises(ValueError, match=f"{field} names token id 999, outside"):
            tiny.generate(["x"], SamplingParams(**{field: value}), use_tqdm=False)
