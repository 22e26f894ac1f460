"""Guided decoding end to end with the built-in model, which almost never writes valid JSON
(or anything else structured) by itself: every output must still parse and match its spec.

The unguided baseline in each test is what makes the guided assertions mean something: the
same prompts, seeds and budget without a grammar fail the check the grammar must pass.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.engine._fixtures import assert_pool_clean
from tokenwise import GuidedDecodingParams, SamplingParams
from tokenwise.entrypoints.llm import LLM

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "kind", "tags"],
    "additionalProperties": False,
}
PROMPT = "def parse(data):\n    return "
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", device="cpu")


def sampled(llm: LLM, n: int, guided: GuidedDecodingParams | None, max_tokens: int = MAX_TOKENS):
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, guided_decoding=guided)
        for i in range(n)
    ]
    return [o.outputs[0] for o in llm.generate([PROMPT] * n, params, use_tqdm=False)]


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_fifty_samples_under_a_json_schema_all_validate(llm: LLM) -> None:
    outs = sampled(llm, 50, GuidedDecodingParams(json=SCHEMA))
    for out in outs:
        assert out.finish_reason == "stop", out.text  # the grammar ended it, not the budget
        jsonschema.validate(json.loads(out.text), SCHEMA)
    # Sampling at temperature 1 explores: the values differ from sample to sample.
    assert len({out.text for out in outs}) > 40
    assert_pool_clean(llm.llm_engine)


def test_without_guidance_the_model_does_not_write_json(llm: LLM) -> None:
    outs = sampled(llm, 20, None, max_tokens=32)
    assert sum(parses(out.text) for out in outs) <= 2


def test_json_object_outputs_parse_as_objects(llm: LLM) -> None:
    outs = sampled(llm, 8, GuidedDecodingParams(json_object=True), max_tokens=64)
    finished = [out for out in outs if out.finish_reason == "stop"]
    assert len(finished) >= 6  # an open-ended object may still run out of tokens
    for out in finished:
        assert isinstance(json.loads(out.text), dict)
    for out in outs:  # a truncated one is still a prefix of an object
        assert out.text.startswith("{")


def test_regex_outputs_match(llm: LLM) -> None:
    pattern = r"[a-z]{2,6}-[0-9]{1,3}(\.[0-9]{2})?"
    outs = sampled(llm, 12, GuidedDecodingParams(regex=pattern), max_tokens=24)
    for out in outs:
        assert re.fullmatch(pattern, out.text), out.text
        assert out.finish_reason == "stop"
    unguided = sampled(llm, 12, None, max_tokens=24)
    assert not any(re.fullmatch(pattern, out.text) for out in unguided)


def test_choice_outputs_are_in_the_set(llm: LLM) -> None:
    choices = ["positive", "negative", 'neutral "quoted"', "ünïcode ✓"]
    outs = sampled(llm, 16, GuidedDecodingParams(choice=choices), max_tokens=16)
    texts = [out.text for out in outs]
    assert set(texts) <= set(choices)
    assert len(set(texts)) >= 2
    assert all(out.finish_reason == "stop" for out in outs)


def test_ebnf_grammar_outputs_are_in_its_language(llm: LLM) -> None:
    grammar = """
root ::= call ("; " call)?
call ::= name "(" arg ("," arg)? ")"
name ::= "add" | "mul" | "neg"
arg ::= [0-9] | [0-9] [0-9]
"""
    # The same language, written as a regular expression.
    call = r"(add|mul|neg)\([0-9]{1,2}(,[0-9]{1,2})?\)"
    language = re.compile(rf"{call}(; {call})?")
    outs = sampled(llm, 12, GuidedDecodingParams(grammar=grammar), max_tokens=40)
    for out in outs:
        assert out.finish_reason == "stop"
        assert language.fullmatch(out.text), out.text
    assert len({out.text for out in outs}) > 3
    assert not any(language.fullmatch(out.text) for out in sampled(llm, 12, None, 40))
