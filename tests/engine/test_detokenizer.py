"""Stop strings in the incremental detokenizer: which one ends the text, and where."""

from __future__ import annotations

import pytest

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
