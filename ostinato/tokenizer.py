"""Tokenizers: the Hugging Face one of a model directory, or a built-in byte tokenizer for presets.

Both give encode, decode, eos_token_id, vocab_size and apply_chat_template.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from ostinato.loader import is_random


def default_chat_prompt(messages: list[dict], tools: list[dict] | None = None) -> str:
    """The template for tokenizers without one: a "role: content" line per message, then
    "assistant: " for the reply; tools first, as a "tools: [JSON]" line."""
    lines = [f"tools: {json.dumps(tools)}\n"] if tools else []
    lines += [f"{m['role']}: {m['content']}\n" for m in messages]
    return "".join(lines) + "assistant: "


class ByteTokenizer:
    """Ids 0..255 are the bytes of the UTF-8 text, then BOS and EOS. encode adds no specials.

    Decoding drops every other id and replaces invalid UTF-8 (e.g. a character cut in half at
    the end of a stream) with U+FFFD, so any prefix of a token stream decodes.
    """

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258
    _specials = {bos_token_id: "<s>", eos_token_id: "</s>"}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
            elif not skip_special_tokens and i in self._specials:
                out += [run.decode("utf-8", errors="replace"), self._specials[i]]
                run = bytearray()
        return "".join(out) + run.decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None
    ) -> list[int]:
        return self.encode(default_chat_prompt(messages, tools))


class HFTokenizer:
    """A transformers fast tokenizer; encode adds the model's special tokens (e.g. BOS)."""

    def __init__(self, path: str) -> None:
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"cannot load a tokenizer from {path}: {e}") from None
        self.eos_token_id: int | None = self.tokenizer.eos_token_id
        self.vocab_size: int = len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None
    ) -> list[int]:
        """The tokenizer's own template with the generation prompt (and the tools, which the
        template renders its own way), else default_chat_prompt. Rendered to text first:
        templates write their special tokens (BOS) themselves."""
        if not self.tokenizer.chat_template:
            return self.encode(default_chat_prompt(messages, tools))
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)


def load_tokenizer(model: str) -> ByteTokenizer | HFTokenizer:
    """The byte tokenizer for `tiny` and `random:<preset>`, else the directory's tokenizer."""
    if is_random(model):
        return ByteTokenizer()
    if not Path(model).is_dir():
        raise ValueError(f"model path {model!r} does not exist")
    return HFTokenizer(model)
