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
from llguidance import LLExecutor, LLMatcher

from ostinato import LLM, SamplingParams
from ostinato.kernels import bitmask as bitmask_kernel
from ostinato.kernels.bitmask import apply_token_bitmask
from ostinato.runner.step import SamplingRow
from ostinato.sampling_params import StructuredOutputsParams
from ostinato.structured import bitmask
from ostinato.structured import grammar as grammar_module
from ostinato.structured.bitmask import TokenBitmask, fill_bitmask
from ostinato.structured.grammar import GrammarCompiler, grammar_text
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


class CountingExecutor:
    """llguidance's executor, counting the calls that fill rows over its threads."""

    def __init__(self) -> None:
        self.executor, self.calls = LLExecutor(), 0

    def unsafe_compute_mask_ptr(self, *args):
        self.calls += 1
        return self.executor.unsafe_compute_mask_ptr(*args)


@pytest.mark.parametrize(("plain", "threads"), [(1, True), (2, True), (3, True), (3, False)])
def test_fill_bitmask_lists_the_constrained_rows_plain_and_drafts(monkeypatch, plain, threads):
    """Rows without drafts are filled in one call over llguidance's threads when there are
    several and the vocabulary is large (from PARALLEL_FROM_VOCAB on), else one by one; a
    request's draft rows as far as its grammar accepts the drafts, and a constrained request
    after them at the logits row after all of its drafts'."""
    if threads:  # llguidance's thread pool, as for large vocabularies: from this one on
        monkeypatch.setattr(bitmask, "PARALLEL_FROM_VOCAB", 258)
    compiler = GrammarCompiler(ByteTokenizer())
    regex = StructuredOutputsParams(regex="ab[0-9]c")
    rows = [
        SamplingRow("free", SamplingParams(), 0),
        SamplingRow("plain", SamplingParams(structured_outputs=regex), 0),
        SamplingRow("json", SamplingParams(structured_outputs=regex), 0),
        # drafts "a", "b", "x": the third is forbidden, so the row after it is never used
        SamplingRow("drafts", SamplingParams(structured_outputs=regex), 0, (97, 98, 120)),
        SamplingRow("after", SamplingParams(structured_outputs=regex), 0),
    ]
    moved, after = compiler.matcher(regex), compiler.matcher(regex)
    moved.consume_tokens([97, 98])
    after.consume_tokens([97])
    matchers = [None, compiler.matcher(regex), moved, compiler.matcher(regex), after]
    matchers[1 : 4 - plain] = [None] * (3 - plain)  # `plain` rows without drafts: 1 to 3
    executor = CountingExecutor()
    mask = fill_bitmask(rows, matchers, 258, executor)
    digits = set(range(ord("0"), ord("9") + 1))
    want = {1: {ord("a")}, 2: digits}  # row 2: its own state, after "ab"
    # the drafts' rows: before any draft, after draft "a", after "ab"; the one after "x" is free
    want.update({3: {ord("a")}, 4: {ord("b")}, 5: digits, 7: {ord("b")}})  # 7: after "a"
    for row in range(1, 4 - plain):
        del want[row]
    assert mask.bits.shape == (len(want), -(-258 // 32))
    assert mask.rows.tolist() == sorted(want)
    assert [_allowed(bits) for bits in mask.bits] == [want[r] for r in sorted(want)]
    assert executor.calls == (threads and plain > 1)
    assert matchers[3].validate_tokens([97]) == 1  # the drafts left the matcher where it was
    assert fill_bitmask(rows[:1], matchers[:1], 258, executor) is None  # none constrained
    with pytest.raises(ValueError):  # a matcher (or None) per row, or the rows would shift
        fill_bitmask(rows, matchers[:-1], 258, executor)


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
    (template,) = compiler._cache.values()
    assert isinstance(template, LLMatcher)  # the compiled grammar, which later requests copy
    b = compiler.matcher(StructuredOutputsParams(json=json.dumps(SCHEMA)))
    assert len(compiler._cache) == 1 and a is not b  # one compile, a matcher per request
    assert list(compiler._cache.values()) == [template]  # b's came from the cache
    a.consume_token(ord("{"))
    assert b.validate_tokens([ord("{")]) == 1  # b did not move with a
    with pytest.raises(ValueError, match="structured_outputs.json: .*objectx"):
        compiler.matcher(StructuredOutputsParams(json={"type": "objectx"}))
    # llguidance's message on one line: its first line and its parser's `error:` line, without
    # its drawing of the regex and of the grammar
    unclosed = (
        'structured_outputs.regex: at 1(8): invalid regex "[a-" (in regex): regex parse '
        "error: error: unclosed character class"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(unclosed)}$"):
        compiler.matcher(StructuredOutputsParams(regex="[a-"))
    with pytest.raises(
        ValueError, match='^structured_outputs.grammar: at 1.8.: unknown name: "foo"$'
    ):
        compiler.matcher(StructuredOutputsParams(grammar="start: foo"))
    with pytest.raises(ValueError, match="^structured_outputs.json: not valid JSON: Expecting "):
        compiler.matcher(StructuredOutputsParams(json="{"))
    with pytest.raises(ValueError, match="^structured_outputs.json: a JSON schema must be an obj"):
        compiler.matcher(StructuredOutputsParams(json="[1, 2]"))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])


def test_the_grammar_cache_keeps_the_most_recently_used():
    """At cache_size grammars, a new one evicts the least recently used; a hit makes a grammar
    the most recent and compiles nothing."""
    compiler = GrammarCompiler(ByteTokenizer(), cache_size=2)
    params = {r: StructuredOutputsParams(regex=r) for r in "abc"}
    text = {r: grammar_text(p) for r, p in params.items()}
    for r in "aba":  # the second "a" is a hit
        compiler.matcher(params[r])
    assert list(compiler._cache) == [text["b"], text["a"]]
    compiler.matcher(params["c"])  # evicts "b", the least recently used
    assert list(compiler._cache) == [text["a"], text["c"]]
    held = compiler._cache[text["c"]]
    compiler.matcher(params["b"])  # compiled again, evicting "a"
    assert list(compiler._cache) == [text["c"], text["b"]] and compiler._cache[text["c"]] is held


def test_the_compiler_times_each_steps_bitmask(monkeypatch):
    """bitmask() adds each call's host time to mask_seconds and counts it in mask_steps;
    with a large vocabulary its rows without drafts go through llguidance's threads."""
    monkeypatch.setattr(bitmask, "PARALLEL_FROM_VOCAB", 0)
    clock = iter([1.0, 1.5, 3.0, 3.25])
    monkeypatch.setattr(grammar_module.time, "perf_counter", lambda: next(clock))
    compiler = GrammarCompiler(ByteTokenizer())
    assert (compiler.mask_seconds, compiler.mask_steps) == (0.0, 0)
    regex = StructuredOutputsParams(regex="ab")
    rows = [SamplingRow(str(i), SamplingParams(structured_outputs=regex), 0) for i in range(2)]
    matchers = [compiler.matcher(regex) for _ in rows]
    mask = compiler.bitmask(rows, matchers)
    assert [_allowed(bits) for bits in mask.bits] == [{ord("a")}] * 2
    assert (compiler.mask_seconds, compiler.mask_steps) == (0.5, 1)
    compiler.bitmask(rows, matchers)
    assert (compiler.mask_seconds, compiler.mask_steps) == (0.75, 2)


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
