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
from helpers import fence_intact, nan_fenced
from llguidance import LLExecutor

from ostinato import LLM, SamplingParams
from ostinato.kernels import bitmask as bitmask_kernel
from ostinato.kernels.bitmask import apply_token_bitmask
from ostinato.runner.step import SamplingRow
from ostinato.sampling_params import StructuredOutputsParams
from ostinato.structured import bitmask
from ostinato.structured.bitmask import TokenBitmask, fill_bitmask
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


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", max_model_len=256, seed=0)


def _params(so: StructuredOutputsParams | None, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": 7, "max_tokens": 64, **kw},
                          structured_outputs=so)  # fmt: skip


def _allowed(row: np.ndarray) -> set[int]:
    """The ids a bitmask row allows, bit by bit."""
    return {i for i in range(32 * len(row)) if (int(row[i // 32]) >> (i % 32)) & 1}


# ---- the bitmask ------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_apply_token_bitmask_matches_a_bit_by_bit_reference(monkeypatch, path):
    """Rows 1, 2 and 4 of 5 constrained, by a mask as wide as a 40-id tokenizer (two words)
    under a 77-id model; the Triton kernel runs interpreted on the CPU. The logits lie among
    NaNs, a gap after each row, which no write reaches (helpers.fence_intact)."""
    if path == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")

        def fail(*args):
            raise AssertionError("the torch path ran")

        monkeypatch.setattr(bitmask_kernel, "apply_token_bitmask_torch", fail)
    gen = torch.Generator().manual_seed(0)
    vocab, tokenizer_vocab = 77, 40  # neither a multiple of 32
    logits = torch.randn(5, vocab, generator=gen, dtype=torch.float64)
    rows = [1, 2, 4]
    words = torch.randint(-(2**31), 2**31 - 1, (3, 2), generator=gen, dtype=torch.int64)
    last = (1 << (tokenizer_vocab - 32)) - 1  # llguidance leaves the ids past it unset
    words[:, 1] &= last
    words[1] = 0  # none
    words[2] = torch.tensor([-1, last])  # every id the tokenizer has
    want = logits.clone()
    for k, r in enumerate(rows):
        for i in range(vocab):
            if i >= tokenizer_vocab or not (int(words[k, i // 32]) >> (i % 32)) & 1:
                want[r, i] = -math.inf
    got = nan_fenced(logits, vocab + 3)
    apply_token_bitmask(got, torch.tensor(rows, dtype=torch.int32), words.to(torch.int32))
    assert torch.equal(got, want) and fence_intact(got)
    assert torch.equal(got[2], torch.full((vocab,), -math.inf, dtype=torch.float64))
    assert torch.equal(got[4][:tokenizer_vocab], logits[4][:tokenizer_vocab])
    assert torch.equal(got[[0, 3]], logits[[0, 3]])  # unconstrained rows keep every token


@pytest.mark.parametrize(("plain", "threads"), [(1, True), (2, True), (2, False)])
def test_fill_bitmask_lists_the_constrained_rows_plain_and_drafts(monkeypatch, plain, threads):
    """Rows without drafts are filled in one call over llguidance's threads when there are
    several and the vocabulary is large, else one by one; a request's draft rows as far as its
    grammar accepts the drafts."""
    if threads:  # llguidance's thread pool, as for large vocabularies
        monkeypatch.setattr(bitmask, "PARALLEL_FROM_VOCAB", 0)
    compiler = GrammarCompiler(ByteTokenizer())
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
    if plain == 1:
        matchers[2] = None
    mask = fill_bitmask(rows, matchers, 258, LLExecutor())
    digits = set(range(ord("0"), ord("9") + 1))
    want = {1: {ord("a")}, 2: digits}  # row 2: its own state, after "ab"
    # the drafts' rows: before any draft, after draft "a", after "ab"; the one after "x" is free
    want.update({3: {ord("a")}, 4: {ord("b")}, 5: digits})
    if plain == 1:
        del want[2]
    assert mask.bits.shape == (len(want), -(-258 // 32))
    assert mask.rows.tolist() == sorted(want)
    assert [_allowed(bits) for bits in mask.bits] == [want[r] for r in sorted(want)]
    assert matchers[3].validate_tokens([97]) == 1  # the drafts left the matcher where it was
    assert fill_bitmask(rows[:1], matchers[:1], 258, LLExecutor()) is None  # none constrained


@pytest.mark.parametrize("num_rows", range(1, 10))
def test_a_masks_rows_and_bits_start_16_bytes_apart_whatever_its_row_count(num_rows):
    """The bitmask kernel compiles a variant per alignment of its pointers: the rows and the
    bits sit at 16-byte offsets of one buffer (the device copy allocates it aligned) for any
    row count, here with 9 words a row (a 258-token vocabulary), and neither overlaps."""
    mask = TokenBitmask.for_rows(list(range(5, 5 + num_rows)), 9)
    data = torch.from_numpy(mask.data)
    rows, bits = mask.split(data)
    bits.fill_(-1)
    assert rows.tolist() == list(range(5, 5 + num_rows)) and bits.shape == (num_rows, 9)
    assert mask.num_rows == num_rows and torch.equal(bits, torch.from_numpy(mask.bits))
    assert rows.data_ptr() == data.data_ptr() and (bits.data_ptr() - data.data_ptr()) % 16 == 0


def test_grammars_are_cached_and_bad_ones_name_the_problem():
    compiler = GrammarCompiler(ByteTokenizer())
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
