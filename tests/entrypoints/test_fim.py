"""Fill-in-the-middle (`suffix` on /v1/completions): the token ids that reach the engine.

The app runs in-process around an engine that records what it is given and answers every
request with one fixed token, so the prompt ids can be checked exactly. The tokenizers are
copies of the tests' tiny BPE with FIM markers added as special tokens (Qwen2.5-Coder's and
StarCoder's spellings), and the plain copy, which has none.
"""

from __future__ import annotations

import copy

import pytest
from tokenizers import processors

from tests.entrypoints._recording_engine import app_for
from tests.tiny_checkpoints import BOS_TOKEN, tiny_tokenizer
from tokenwise.entrypoints.openai.fim import fim_prompt

QWEN = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
STARCODER = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n    return total\n"


def with_markers(markers: list[str] | None):
    tok = copy.deepcopy(tiny_tokenizer())
    if markers:
        tok.add_special_tokens({"additional_special_tokens": markers})
    return tok


@pytest.mark.timeout(60)
@pytest.mark.parametrize("markers", [QWEN, STARCODER], ids=["qwen", "starcoder"])
def test_suffix_builds_a_prefix_suffix_middle_prompt(markers: list[str]) -> None:
    tok = with_markers(markers)
    prefix_id, suffix_id, middle_id = tok.convert_tokens_to_ids(markers)
    assert len({prefix_id, suffix_id, middle_id}) == 3 and min(prefix_id, suffix_id) >= 300
    client, engine = app_for(tok)
    with client:
        body = {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == "total = a + b"
        # A batch of prompts: each gets the same suffix.
        body = {"prompt": ["x = ", "y = "], "suffix": "\nprint(x)", "max_tokens": 4}
        assert client.post("/v1/completions", json=body).status_code == 200
    (ids,) = [p["prompt_token_ids"] for p in engine.prompts[:1]]
    prefix_ids = tok.encode(PREFIX, add_special_tokens=False)
    suffix_ids = tok.encode(SUFFIX, add_special_tokens=False)
    assert ids == [prefix_id, *prefix_ids, suffix_id, *suffix_ids, middle_id]
    assert ids.count(prefix_id) == ids.count(suffix_id) == ids.count(middle_id) == 1
    # The prompt's text is what those ids read, markers and all (echo shows it).
    assert engine.prompts[0]["prompt"] == f"{markers[0]}{PREFIX}{markers[1]}{SUFFIX}{markers[2]}"
    batch = [p["prompt_token_ids"] for p in engine.prompts[1:]]
    tail = [suffix_id, *tok.encode("\nprint(x)", add_special_tokens=False), middle_id]
    assert batch == [
        [prefix_id, *tok.encode(text, add_special_tokens=False), *tail] for text in ("x = ", "y = ")
    ]


@pytest.mark.timeout(60)
def test_no_suffix_or_empty_suffix_leaves_the_prompt_alone() -> None:
    tok = with_markers(QWEN)
    client, engine = app_for(tok)
    with client:
        for extra in ({}, {"suffix": ""}, {"suffix": None}):
            body = {"prompt": PREFIX, "max_tokens": 2, **extra}
            assert client.post("/v1/completions", json=body).status_code == 200
    assert engine.prompts == [PREFIX] * 3  # text prompts, tokenized by the engine as before


def error_of(response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


@pytest.mark.timeout(60)
def test_suffix_is_refused_naming_it_where_it_cannot_work() -> None:
    client, engine = app_for(with_markers(None))
    with client:
        body = {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4}
        message = error_of(client.post("/v1/completions", json=body), "suffix")
        assert "no fill-in-the-middle tokens" in message and "<|fim_prefix|>" in message
    # Only part of a set is no set.
    client, _ = app_for(with_markers(QWEN[:2]))
    with client:
        error_of(client.post("/v1/completions", json=body), "suffix")
    client, engine_with = app_for(with_markers(QWEN))
    with client:
        ids = {"prompt": [5, 6, 7], "suffix": SUFFIX, "max_tokens": 4}
        assert "token ids" in error_of(client.post("/v1/completions", json=ids), "suffix")
        wrong_type = {"prompt": PREFIX, "suffix": 3, "max_tokens": 4}
        error_of(client.post("/v1/completions", json=wrong_type), "suffix")
    assert engine.prompts == [] and engine_with.prompts == []


def test_bos_comes_first_where_the_tokenizer_adds_one() -> None:
    """A tokenizer that puts BOS before a plain prompt puts it before the FIM prompt too (and
    `add_special_tokens: false` leaves it out, as for a plain prompt)."""
    tok = with_markers(QWEN)
    bos = tok.convert_tokens_to_ids(BOS_TOKEN)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, bos)]
    )
    assert tok.encode("x")[0] == bos
    prefix_id = tok.convert_tokens_to_ids(QWEN[0])
    with_bos = fim_prompt(tok, PREFIX, SUFFIX, add_special_tokens=True)["prompt_token_ids"]
    without = fim_prompt(tok, PREFIX, SUFFIX, add_special_tokens=False)["prompt_token_ids"]
    assert with_bos == [bos, *without] and without[0] == prefix_id
    assert bos not in without
