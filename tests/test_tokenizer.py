"""The byte tokenizer of the presets and the Hugging Face tokenizer of a model directory."""

from __future__ import annotations

import pytest
import transformers
from helpers import make_hf_checkpoint
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from ostinato.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEXT = "héllo, wörld! 🙂 the quick brown fox"


def test_byte_tokenizer_round_trips_and_drops_ids_outside_the_bytes():
    tok = load_tokenizer("tiny")
    assert isinstance(tok, ByteTokenizer) and isinstance(
        load_tokenizer("random:qwen3-0.6b"), ByteTokenizer
    )
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode()) and tok.decode(ids) == TEXT
    assert tok.eos_token_id == 257 and tok.vocab_size == 258
    assert tok.decode([tok.bos_token_id, *ids, tok.eos_token_id, 300, -1]) == TEXT
    assert tok.decode([256, 104, 105, 257], skip_special_tokens=False) == "<s>hi</s>"
    # a prefix that cuts a character in half still decodes (incremental detokenisation)
    assert tok.decode(ids[:2]) == "h\ufffd"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == list(
        b"user: hi\nassistant: "
    )


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_checkpoint("qwen3", tmp_path_factory.mktemp("tok"))


def test_hf_tokenizer_round_trips_with_bos_and_eos(hf_dir):
    tok = load_tokenizer(str(hf_dir))
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode(TEXT)
    assert ids[0] == 0 and len(ids) < len(TEXT.encode())  # BOS, then merged byte pieces
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + TEXT
    assert tok.eos_token_id == 1 and tok.vocab_size == 300


def test_hf_tokenizer_chat_template_and_default(hf_dir, tmp_path):
    tok = load_tokenizer(str(hf_dir))
    messages = [{"role": "user", "content": "hi"}]
    assert tok.decode(tok.apply_chat_template(messages)) == "<|user|>hi\n<|assistant|>"
    tok.tokenizer.chat_template = None
    ids = tok.apply_chat_template(messages)
    assert ids[0] == 0 and tok.decode(ids) == "user: hi\nassistant: "


def test_directory_without_a_tokenizer_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_incremental_detokenizer_streams_exactly_the_decoded_text(kind, hf_dir):
    """Token by token, the pieces join to the whole decode; a character cut in half is held
    back (never a U+FFFD in the stream) until its last byte, or `final` flushes it."""
    from ostinato.engine.detokenizer import IncrementalDetokenizer

    tok = ByteTokenizer() if kind == "bytes" else HFTokenizer(str(hf_dir))
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.update(ids[: i + 1]) for i in range(len(ids))]
    assert "".join(pieces) == detok.text == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)
    if kind == "bytes":
        cut = TEXT.encode().index("é".encode()) + 1  # ids up to the first byte of é
        assert pieces[cut - 1] == "" and pieces[cut] == "é"
        flushed = IncrementalDetokenizer(tok)
        assert flushed.update(ids[:cut]) == ""  # the window ends mid-character: held back
        assert flushed.update(ids[:cut], final=True) == "h\ufffd"  # the request ended there
        assert flushed.text == "h\ufffd"


def test_a_token_that_adds_no_text_keeps_the_window_context(tmp_path):
    """SentencePiece decoding drops the space of a window's first word: a skipped special
    token between two words must not start a new window, or the space between them is lost."""
    from ostinato.engine.detokenizer import IncrementalDetokenizer

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "▁hello": 3, "▁world": 4}
    sp = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=sp, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(tmp_path)
    detok = IncrementalDetokenizer(HFTokenizer(str(tmp_path)))
    ids = [3, 0, 4]  # hello <s> world
    assert [detok.update(ids[: i + 1]) for i in range(3)] == ["hello", "", " world"]
    assert detok.text == "hello world"


def test_cut_at_stop_cuts_before_the_first_occurrence():
    from ostinato.engine.detokenizer import IncrementalDetokenizer, cut_at_stop

    detok = IncrementalDetokenizer(ByteTokenizer())
    detok.update(list(b"a. b. c"))
    assert not cut_at_stop(detok, ["x", "c."]) and not detok.text_stopped
    assert detok.text == "a. b. c"
    assert cut_at_stop(detok, ["x", ". "]) and detok.text_stopped
    assert detok.text == "a"
    at_start = IncrementalDetokenizer(ByteTokenizer())
    at_start.update(list(b"xyz"))
    assert cut_at_stop(at_start, ["y"]) and at_start.text == "x"  # a stop at index 1
    assert cut_at_stop(at_start, ["x"]) and at_start.text == ""
