"""The incremental detokenizer: stop strings (which one ends the text, and where), and both
decoders (DecodeStream, the Python window) against `tokenizer.decode`."""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from tests.tiny_checkpoints import tiny_tokenizer
from tokenwise.engine.detokenizer import IncrementalDetokenizer

TEXT = "the cat sat on the mat"


def feed(stop: list[str], include: bool = False) -> tuple[str | None, str]:
    tok = tiny_tokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"), stop, include, True)
    for token in tok.encode(TEXT, add_special_tokens=False):
        found = detok.add_token(token)
        if found is not None:
            return found, detok.take_new_text(True)
    return None, detok.take_new_text(True)


@pytest.mark.parametrize("stop", [["e", "h"], ["h", "e"], ["at", "h"], ["mat", "h", "cat"]])
def test_earliest_stop_string_wins_whatever_the_list_order(stop: list[str]) -> None:
    found, text = feed(stop)
    first = min((TEXT.find(s), s) for s in stop if s in TEXT)
    assert (found, text) == (first[1], TEXT[: first[0]])
    assert not any(s in text for s in stop)


def test_longer_stop_wins_at_the_same_position() -> None:
    # " sat" is one token, so both stops appear in the same new text, at the same index.
    assert feed(["sa", "sat"], include=True) == ("sat", "the cat sat")


# ---- both decoders against `tokenizer.decode` (property tests) -------------------------------

PROMPT_ALPHABET = "ab cé日😀\n"


def run_detokenizer(
    tok: Any,
    prompt: str,
    ids: list[int],
    stop: list[str],
    include: bool,
    skip_special: bool,
    use_decode_stream: bool,
) -> tuple[str, list[int], str | None]:
    """Feed `ids` as an engine does, up to the first stop string: (all text, ids fed, stop)."""
    detok = IncrementalDetokenizer(
        tok, tok.encode(prompt), stop, include, skip_special, use_decode_stream
    )
    assert detok.uses_decode_stream is use_decode_stream
    chunks, fed, found = [], [], None
    for token in ids:
        fed.append(token)
        found = detok.add_token(token)
        if found is not None:
            break
        chunks.append(detok.take_new_text(False))
    chunks.append(detok.take_new_text(True))
    return "".join(chunks), fed, found


def cut_at_first_stop(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """The documented truncation: at the earliest stop string, the longer one on a tie."""
    found = [(at, -len(s), s) for s in stop if s and (at := text.find(s)) >= 0]
    if not found:
        return text, None
    at, _, s = min(found)
    return text[: at + len(s) if include else at], s


@lru_cache(maxsize=1)
def default_model_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from tokenwise.default_model import DEFAULT_MODEL_DIR

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


TOKENIZERS = {"tiny_bpe": tiny_tokenizer, "default_model": default_model_tokenizer}


@pytest.mark.parametrize("use_decode_stream", [True, False], ids=["stream", "window"])
@pytest.mark.parametrize("which", list(TOKENIZERS))
@settings(max_examples=60, deadline=None)
@given(data=st.data(), prompt=st.text(PROMPT_ALPHABET, max_size=12), skip=st.booleans())
def test_text_is_the_decode_of_all_output_ids(
    which: str, use_decode_stream: bool, data: st.DataObject, prompt: str, skip: bool
) -> None:
    # Random ids, not only encodings of text: byte tokens that split, or never complete, a
    # multi-byte character, and special tokens. The prompt is text (a character boundary).
    tok = TOKENIZERS[which]()
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=40), label="ids")
    text, _, found = run_detokenizer(tok, prompt, ids, [], False, skip, use_decode_stream)
    assert found is None
    # A character cut off by the end of the ids is never emitted; all else is.
    assert text == tok.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")


@pytest.mark.parametrize("use_decode_stream", [True, False], ids=["stream", "window"])
@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    stop=st.lists(st.text("ab cé日", min_size=1, max_size=3), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_text_is_the_decode_cut_at_the_first_stop_string(
    use_decode_stream: bool, data: st.DataObject, stop: list[str], include: bool
) -> None:
    tok = tiny_tokenizer()
    # Mostly text made of the stops' characters, so that stops occur, across token boundaries.
    words = data.draw(st.text("ab cé日", max_size=30), label="text")
    ids = tok.encode(words, add_special_tokens=False)
    text, fed, found = run_detokenizer(tok, "Hi", ids, stop, include, True, use_decode_stream)
    full = tok.decode(fed).rstrip("\ufffd")
    expected, expected_stop = cut_at_first_stop(full, stop, include)
    assert (text, found) == (expected, expected_stop)
    if found is not None:  # it stopped at the first token whose text completes the stop
        assert cut_at_first_stop(tok.decode(fed[:-1]), stop, include)[1] is None


def test_decode_stream_is_used_for_fast_tokenizers_only() -> None:
    tok = tiny_tokenizer()
    assert IncrementalDetokenizer(tok, [1]).uses_decode_stream
    slow = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "")
    assert not IncrementalDetokenizer(slow, [1]).uses_decode_stream
    with pytest.raises(ValueError, match="not a fast tokenizer"):
        IncrementalDetokenizer(slow, [1], use_decode_stream=True)


class _BrokenStream:
    """A DecodeStream in the state tokenizers reports as an invalid prefix (vLLM #17448)."""

    def __init__(self, message: str) -> None:
        self.message = message

    def step(self, tokenizer: Any, token: Any) -> str | None:
        raise Exception(f"{self.message} Token ID: {token}")


def test_decode_stream_restarts_after_an_invalid_prefix_error() -> None:
    tok = tiny_tokenizer()
    ids = tok.encode("the cat sat 日本 on the mat", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"), use_decode_stream=True)
    cut = next(i for i, t in enumerate(ids) if "\ufffd" in tok.decode([t]))  # mid-character
    for token in ids[: cut + 1]:
        detok.add_token(token)
    detok.decoder.stream = _BrokenStream("Invalid prefix encountered while decoding stream.")
    for token in ids[cut + 1 :]:
        detok.add_token(token)
    # The fresh stream starts from the held-back bytes, so the character survives.
    assert detok.take_new_text(True) == tok.decode(ids)

    detok.decoder.stream = _BrokenStream("some other failure")
    with pytest.raises(Exception, match="some other failure"):
        detok.add_token(ids[0])
