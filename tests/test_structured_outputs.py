"""Structured outputs offline: the bitmask against masks computed here, grammars that force
valid output on random weights, async scheduling and speculation with constraints."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import numpy as np
import pytest
import torch
from llguidance import LLExecutor

from ostinato import LLM, SamplingParams
from ostinato.runner.step import SamplingRow
from ostinato.sampling_params import StructuredOutputsParams
from ostinato.structured import bitmask
from ostinato.structured.bitmask import apply_bitmask, fill_bitmask
from ostinato.structured.grammar import GrammarCompiler
from ostinato.tokenizer import ByteTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["Hello, my name is", "1, 2, 3,"]
TINY_VOCAB = 384  # the tiny model's logits; its byte tokenizer has 258 ids


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", max_model_len=256, seed=0)


def _params(so: StructuredOutputsParams | None, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": 7, "max_tokens": 64, **kw},
                          structured_outputs=so)  # fmt: skip


def _allowed(row: np.ndarray, vocab: int) -> set[int]:
    """The ids a bitmask row allows, bit by bit."""
    return {i for i in range(vocab) if (int(row[i // 32]) >> (i % 32)) & 1}


# ---- the bitmask ------------------------------------------------------------------------
def test_apply_bitmask_matches_a_bit_by_bit_reference():
    gen = torch.Generator().manual_seed(0)
    vocab = 77  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(5, vocab, generator=gen, dtype=torch.float64)
    words = torch.randint(-(2**31), 2**31 - 1, (5, 3), generator=gen, dtype=torch.int64)
    words[1] = -1  # every token
    words[2] = 0  # none
    bitmask = words.to(torch.int32)
    want = logits.clone()
    for r in range(5):
        for i in range(vocab):
            if not (int(words[r, i // 32]) >> (i % 32)) & 1:
                want[r, i] = -math.inf
    got = logits.clone()
    apply_bitmask(got, bitmask)
    assert torch.equal(got, want)
    assert torch.equal(got[1], logits[1])


@pytest.mark.parametrize("threads", [False, True])
def test_fill_bitmask_rows_plain_constrained_and_drafts(monkeypatch, threads):
    if threads:  # llguidance's thread pool, as for large vocabularies
        monkeypatch.setattr(bitmask, "PARALLEL_FROM_VOCAB", 0)
    compiler = GrammarCompiler(ByteTokenizer(), TINY_VOCAB)
    regex = StructuredOutputsParams(regex="ab[0-9]c")
    rows = [
        SamplingRow("free", SamplingParams(), 0),
        SamplingRow("plain", SamplingParams(structured_outputs=regex), 0),
        SamplingRow("json", SamplingParams(structured_outputs=regex), 0),
        # drafts "a", "b", "x": the third is forbidden, so the row after it is never used
        SamplingRow("drafts", SamplingParams(structured_outputs=regex), 0, (97, 98, 120)),
    ]
    moved = compiler.matcher(regex)
    moved.consume_tokens([97, 98])
    matchers = [None, compiler.matcher(regex), moved, compiler.matcher(regex)]
    mask = fill_bitmask(rows, matchers, compiler.words, 258, LLExecutor())
    assert mask.shape == (1 + 1 + 1 + 4, -(-TINY_VOCAB // 32))
    assert (mask[0] == -1).all()
    digits = set(range(ord("0"), ord("9") + 1))
    assert _allowed(mask[1], TINY_VOCAB) == {ord("a")}
    assert _allowed(mask[2], TINY_VOCAB) == digits  # its own state: after "ab"
    assert _allowed(mask[3], TINY_VOCAB) == {ord("a")}  # before any draft
    assert _allowed(mask[4], TINY_VOCAB) == {ord("b")}  # after draft "a"
    assert _allowed(mask[5], TINY_VOCAB) == digits  # after "ab"
    assert (mask[6] == -1).all()  # after the forbidden "x": unused
    assert matchers[3].validate_tokens([97]) == 1  # the drafts left the matcher where it was


def test_grammars_are_cached_and_bad_ones_name_the_problem():
    compiler = GrammarCompiler(ByteTokenizer(), TINY_VOCAB)
    a = compiler.matcher(StructuredOutputsParams(json=SCHEMA))
    b = compiler.matcher(StructuredOutputsParams(json=json.dumps(SCHEMA)))
    assert len(compiler._cache) == 1 and a is not b  # one compile, a matcher per request
    a.consume_token(ord("{"))
    assert b.validate_tokens([ord("{")]) == 1  # b did not move with a
    with pytest.raises(ValueError, match="structured_outputs.json: .*objectx"):
        compiler.matcher(StructuredOutputsParams(json={"type": "objectx"}))
    with pytest.raises(ValueError, match="structured_outputs.regex: .*unclosed"):
        compiler.matcher(StructuredOutputsParams(regex="[a-"))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])


# ---- generation -------------------------------------------------------------------------
def test_json_schema_forces_valid_json_on_random_weights(llm):
    free = llm.generate(PROMPTS, _params(None, temperature=0.0), use_tqdm=False)
    for out in free:  # the constraint is what makes the output JSON
        with pytest.raises(json.JSONDecodeError):
            json.loads(out.text)
    so = StructuredOutputsParams(json=SCHEMA)
    for temperature in (0.0, 1.0):
        outs = llm.generate(PROMPTS, _params(so, temperature=temperature), use_tqdm=False)
        for out in outs:
            jsonschema.validate(json.loads(out.text), SCHEMA)
            assert out.finish_reason == "stop"


@pytest.mark.parametrize(
    ("so", "check"),
    [
        (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{2}"),
         lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2}", t)),
        (StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
         lambda t: t in ("yes", "no", "maybe so")),
        (StructuredOutputsParams(grammar='start: "(" ("x" | "y")+ ")"'),
         lambda t: re.fullmatch(r"\([xy]+\)", t)),
    ],
    ids=["json_object", "regex", "choice", "grammar"],
)  # fmt: skip
def test_each_kind_of_constraint(llm, so, check):
    for out in llm.generate(PROMPTS, _params(so), use_tqdm=False):
        assert check(out.text), out.text
        assert out.finish_reason == "stop"  # the finished grammar ends the request


def test_bad_schema_is_refused_before_anything_runs(llm):
    bad = _params(StructuredOutputsParams(json={"type": "objectx"}))
    with pytest.raises(ValueError, match="prompt 1: structured_outputs.json"):
        llm.generate(["fine", "bad"], [_params(None), bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_async_scheduling_defers_the_mask_and_changes_nothing():
    """With async scheduling a constrained request's next step launches before its token is
    read; its sampling waits for the mask. Outputs equal those without it."""
    so = StructuredOutputsParams(json=SCHEMA)
    params = [_params(so), _params(None, max_tokens=12), _params(so, temperature=0.0)]
    prompts = [*PROMPTS, "Once"]
    kw = {"device": "cpu", "max_model_len": 256}
    want = LLM("tiny", async_scheduling=False, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM("tiny", async_scheduling=True, **kw)
    held = []
    submit = llm.engine.executor.submit

    def counting(step):
        held.append(step.mask_pending)
        return submit(step)

    llm.engine.executor.submit = counting
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(held) > 5  # most constrained steps overlapped the one before
    jsonschema.validate(json.loads(got[0].text), SCHEMA)


def test_speculation_rejects_drafts_the_grammar_forbids():
    """n-gram drafts copy the prompt, which the grammar forbids: they are rejected, and the
    greedy output equals the one without speculation."""
    so = StructuredOutputsParams(regex=r"(ab){1,12}c")
    prompt = "abababababab xyz xyz xyz xyz xyz"  # drafts propose "xyz" and "ab..."
    kw = {"device": "cpu", "max_model_len": 256}
    params = _params(so, temperature=0.0)
    want = LLM("tiny", **kw).generate([prompt], params, use_tqdm=False)[0]
    spec = LLM("tiny", speculative_method="ngram", num_speculative_tokens=3, **kw)
    got = spec.generate([prompt], params, use_tqdm=False)[0]
    assert re.fullmatch(r"(ab){1,12}c", got.text)
    assert got.token_ids == want.token_ids
    assert spec.stats()["spec_draft_tokens"] > 0
