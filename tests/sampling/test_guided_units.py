"""The pieces of guided decoding on their own: the spec's checks, parse errors, the bitmask
(checked against the allowed set computed from the tokenizer directly), the compile cache and
the compile timeout."""

from __future__ import annotations

import pickle
from concurrent.futures import Future

import pytest
import torch
from transformers import AutoTokenizer

from tokenwise.default_model import DEFAULT_MODEL_DIR
from tokenwise.sampling.guided.bitmask import apply_grammar_bitmask
from tokenwise.sampling.guided.compiler import GrammarCompileCache, grammar_compile_timeout_s
from tokenwise.sampling.guided.grammar import build_grammar
from tokenwise.sampling.guided.params import GuidedDecodingParams
from tokenwise.sampling.guided.state import GrammarState
from tokenwise.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def cache(tokenizer) -> GrammarCompileCache:
    return GrammarCompileCache(tokenizer, vocab_size=len(tokenizer) + 60)  # padded, as models are


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({"choice": []}, "guided_decoding.choice must be a non-empty list"),
        ({"choice": ["a", ""]}, "guided_decoding.choice must contain only non-empty"),
        ({"choice": "ab"}, "guided_decoding.choice must be a non-empty list"),
        ({"regex": 5}, "guided_decoding.regex must be a non-empty str"),
        ({"json": "[1, 2"}, "guided_decoding.json is not valid JSON"),
        ({"json": "[1, 2]"}, "guided_decoding.json must be a JSON schema object"),
        ({"json_object": "yes"}, "guided_decoding.json_object must be True"),
    ],
)
def test_spec_shape_is_checked_eagerly(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GuidedDecodingParams(**kwargs)


def test_sampling_params_carry_the_spec_and_pickle() -> None:
    params = SamplingParams(guided_decoding=GuidedDecodingParams(json='{"type": "integer"}'))
    again = pickle.loads(pickle.dumps(params))  # how data-parallel ranks receive it
    assert again.guided_decoding == GuidedDecodingParams(json={"type": "integer"})
    with pytest.raises(ValueError, match="guided_decoding must be a GuidedDecodingParams"):
        SamplingParams(guided_decoding={"json": {}})  # type: ignore[arg-type]


def test_cache_key_ignores_schema_formatting() -> None:
    a = GuidedDecodingParams(json={"type": "object", "required": ["x"]})
    b = GuidedDecodingParams(json='{ "required": ["x"],\n "type": "object" }')
    assert a.cache_key() == b.cache_key()
    assert a.cache_key() != GuidedDecodingParams(json={"type": "object"}).cache_key()


@pytest.mark.parametrize(
    ("spec", "prefix"),
    [
        (GuidedDecodingParams(json={"type": "nope"}), "guided_decoding.json: invalid JSON schema"),
        (GuidedDecodingParams(regex="[z-a]"), "guided_decoding.regex: invalid regex"),
        (GuidedDecodingParams(grammar="root ::= "), "guided_decoding.grammar: invalid grammar"),
    ],
)
def test_invalid_specs_name_the_field(spec: GuidedDecodingParams, prefix: str) -> None:
    with pytest.raises(ValueError) as info:
        build_grammar(spec)
    assert str(info.value).startswith(prefix)
    assert "\n" not in str(info.value) and ".cc:" not in str(info.value)


def ready_state(cache: GrammarCompileCache, spec: GuidedDecodingParams) -> GrammarState:
    state = GrammarState(cache.submit(spec), (0,), timeout_s=30.0)
    state.compiled.result(timeout=60)
    assert state.poll()
    return state


def test_bitmask_allows_exactly_the_grammars_next_tokens(cache, tokenizer) -> None:
    """A choice of "return"/"raise": the first token may be any token that starts one of them."""
    state = ready_state(cache, GuidedDecodingParams(choice=["return", "raise"]))
    vocab = cache.vocab_size
    logits = torch.zeros(3, vocab)
    apply_grammar_bitmask(logits, [None, state, None], vocab)
    decoded = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    expected = {
        i for i, s in enumerate(decoded) if s and ("return".startswith(s) or "raise".startswith(s))
    }
    allowed = set(torch.nonzero(logits[1] == 0).flatten().tolist())
    assert allowed == expected and len(expected) > 2
    assert (logits[[0, 2]] == 0).all()  # unguided rows untouched
    assert torch.isinf(logits[1, len(tokenizer) :]).all()  # padding ids never allowed
    # After "ret", only the tokens that continue to "return" remain.
    for token in tokenizer.encode("ret", add_special_tokens=False):
        assert state.accept(token)
    logits = torch.zeros(1, vocab)
    apply_grammar_bitmask(logits, [state], vocab)
    allowed = {decoded[i] for i in torch.nonzero(logits[0] == 0).flatten().tolist()}
    assert allowed and all("urn".startswith(s) for s in allowed)
    for token in tokenizer.encode("urn", add_special_tokens=False):
        assert state.accept(token)
    assert not state.is_terminated and state.accept(0)  # EOS ends it
    assert state.is_terminated


def test_logits_wider_than_the_grammar_vocab_are_masked(cache) -> None:
    state = ready_state(cache, GuidedDecodingParams(regex="[a-z]+"))
    logits = torch.zeros(1, cache.vocab_size + 32)
    apply_grammar_bitmask(logits, [state], cache.vocab_size)
    assert torch.isinf(logits[0, cache.vocab_size :]).all()


def test_a_spec_compiles_once(cache) -> None:
    spec = GuidedDecodingParams(regex="[0-9]{4}")
    before = cache.num_compiles
    first, second = cache.submit(spec), cache.submit(GuidedDecodingParams(regex="[0-9]{4}"))
    assert first is second and cache.num_compiles == before + 1
    first.result(timeout=60)


def test_a_slow_compile_times_out_with_a_clear_error() -> None:
    never: Future = Future()
    now = [100.0]  # a fake clock: the test moves time, not the machine's load
    state = GrammarState(never, (0,), timeout_s=0.05, clock=lambda: now[0])
    now[0] += 0.04
    assert not state.poll() and state.error is None  # still within its time
    now[0] += 0.02
    assert not state.poll()
    assert "did not compile within 0.05 s" in (state.error or "")


def test_compile_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENWISE_GRAMMAR_COMPILE_TIMEOUT_S", raising=False)
    assert grammar_compile_timeout_s() == 30.0
    monkeypatch.setenv("TOKENWISE_GRAMMAR_COMPILE_TIMEOUT_S", "2.5")
    assert grammar_compile_timeout_s() == 2.5
    monkeypatch.setenv("TOKENWISE_GRAMMAR_COMPILE_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="TOKENWISE_GRAMMAR_COMPILE_TIMEOUT_S must be"):
        grammar_compile_timeout_s()
