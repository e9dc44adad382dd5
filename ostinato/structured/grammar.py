"""Grammars of structured outputs, compiled by llguidance for the engine's tokenizer.

A request's StructuredOutputsParams becomes one llguidance grammar; the compiled matcher is
cached per grammar text (the engine has one tokenizer), and each request advances its own copy.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Sequence
from functools import cached_property

import llguidance
import llguidance.hf
from llguidance import LLMatcher, LLTokenizer

from ostinato.runner.step import SamplingRow
from ostinato.sampling_params import StructuredOutputsParams
from ostinato.structured.bitmask import TokenBitmask, fill_bitmask

# Compact JSON (no free whitespace): the model may not pad its answer with blanks forever.
JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of params; ValueError naming the field when it is malformed."""
    kind = params.kind
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("structured_outputs.json: a JSON schema must be an object")
        return LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, params.choice)))
    return LLMatcher.grammar_from_lark(params.grammar)


def _one_line(error: str) -> str:
    """llguidance's message without its drawing of the grammar: the first line, and the
    parser's own `error:` line when there is one."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    detail = [line for line in lines[1:] if line.startswith("error:")]
    return " ".join(lines[:1] + detail)


class _ByteVocabulary:
    """The built-in byte tokenizer as llguidance reads a tokenizer: each id's bytes (special
    tokens marked by a leading 0xff), and an encoder."""

    def __init__(self, tokenizer) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        specials = (self.bos_token_id, self.eos_token_id)
        self.tokens = [bytes([i]) for i in range(256)] + [b"\xff<s>", b"\xff</s>"]
        self.special_token_ids = list(specials)

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer; fills the token bitmasks of a step."""

    def __init__(self, tokenizer, cache_size: int = 256) -> None:
        self._tokenizer = tokenizer
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()
        self.cache_size = cache_size
        self.mask_seconds = 0.0  # host time spent filling bitmasks
        self.mask_steps = 0  # steps that had a bitmask

    @cached_property
    def ll_tokenizer(self) -> LLTokenizer:
        """Built on first use: reading a large HF vocabulary takes about a second."""
        hf = getattr(self._tokenizer, "tokenizer", None)
        if hf is not None:
            return llguidance.hf.from_tokenizer(hf)
        return LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary(self._tokenizer)))

    @cached_property
    def executor(self) -> llguidance.LLExecutor:
        return llguidance.LLExecutor()

    def matcher(self, params: StructuredOutputsParams) -> LLMatcher:
        """A fresh matcher at the start of params' grammar; ValueError naming the problem."""
        grammar = grammar_text(params)
        template = self._cache.get(grammar)
        if template is None:
            error = LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
            if error:
                raise ValueError(f"structured_outputs.{params.kind}: {_one_line(error)}")
            template = LLMatcher(self.ll_tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"structured_outputs.{params.kind}: {template.get_error()}")
            self._cache[grammar] = template
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(grammar)
        return template.deep_copy()

    def bitmask(
        self, rows: Sequence[SamplingRow], matchers: Sequence[LLMatcher | None]
    ) -> TokenBitmask | None:
        """The allowed tokens of a step's constrained logits rows (see fill_bitmask), timed."""
        start = time.perf_counter()
        mask = fill_bitmask(rows, matchers, self.ll_tokenizer.vocab_size, self.executor)
        self.mask_seconds += time.perf_counter() - start
        self.mask_steps += 1
        return mask
