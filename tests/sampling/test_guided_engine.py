"""Guided requests inside the engine: sharing batches with unguided ones, preemption, waiting
for a slow compile, timeouts, bad specs, the compile cache, n > 1 and a padded vocabulary.
Every test ends with the KV pool clean: guided requests leak nothing either."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import jsonschema
import pytest
import torch

from tests.engine._fixtures import assert_pool_clean
from tests.tiny_checkpoints import TOKENIZER_VOCAB_SIZE, build_tiny_checkpoint
from tokenwise import GuidedDecodingParams, SamplingParams
from tokenwise.entrypoints.llm import LLM
from tokenwise.outputs import RequestOutput
from tokenwise.sampling.guided.compiler import GrammarCompileCache

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "color": {"enum": ["red", "green", "blue"]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["id", "color", "flags"],
    "additionalProperties": False,
}
GUIDED = GuidedDecodingParams(json=SCHEMA)
PROMPT = "import json\n\nCONFIG = "


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", device="cpu")


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_to_end(engine: Any, max_steps: int = 2000) -> dict[str, RequestOutput]:
    """Step until idle; the merged final output of every request."""
    final: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.request_id in final:
                final[out.request_id].merge(out)
            else:
                final[out.request_id] = out
    raise AssertionError("the engine did not finish")


def test_guided_and_unguided_share_batches(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].text for o in llm.generate([PROMPT, "def main():"], greedy)]
    params = [
        greedy,
        SamplingParams(temperature=1.0, seed=3, max_tokens=64, guided_decoding=GUIDED),
    ]
    params = [params[i % 2] for i in range(8)]
    prompts = [PROMPT, PROMPT, "def main():", PROMPT] * 2
    steps_before = llm.llm_engine.get_stats().num_steps_total
    outs = llm.generate(prompts, params, use_tqdm=False)
    steps = llm.llm_engine.get_stats().num_steps_total - steps_before
    # The unguided rows are untouched by their guided neighbours' masks...
    assert outs[0].outputs[0].text == alone[0] and outs[2].outputs[0].text == alone[1]
    assert not valid(alone[0])
    # ...the guided rows all validate, and all of it ran as one batch (64 steps, not 8 x ~).
    assert all(valid(o.outputs[0].text) for o in outs[1::2])
    assert steps <= 64
    assert_pool_clean(llm.llm_engine)


def test_guided_output_stays_valid_under_preemption() -> None:
    llm = LLM(dtype="float32", device="cpu", max_model_len=96, num_gpu_blocks=8, block_size=16)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=80, guided_decoding=GUIDED)
              for i in range(6)]  # fmt: skip
    outs = llm.generate([PROMPT] * 6, params, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions_total > 0
    for out in outs:
        assert out.outputs[0].finish_reason == "stop" and valid(out.outputs[0].text)
    assert_pool_clean(llm.llm_engine)


def test_n_samples_each_follow_the_grammar(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=64, guided_decoding=GUIDED)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(valid(c.text) for c in out.outputs)
    assert len({c.text for c in out.outputs}) > 1


def test_grammar_end_stops_even_with_ignore_eos(llm: LLM) -> None:
    params = SamplingParams(
        max_tokens=50, ignore_eos=True, guided_decoding=GuidedDecodingParams(choice=["yes", "no"])
    )
    out = llm.generate("Answer:", params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert len(out.token_ids) <= 3


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ({"json": {"type": "object", "properties": 3}}, ["guided_decoding.json", "properties"]),
        ({"json": '{"type": "strin'}, ["guided_decoding.json", "not valid JSON"]),
        ({"regex": "a(b"}, ["guided_decoding.regex", "parenthesis"]),
        ({"grammar": 'root ::= item\nitem ::= "x" other'}, ["guided_decoding.grammar", "other"]),
    ],
)
def test_bad_specs_fail_at_submission_and_the_engine_serves_on(
    llm: LLM, spec: dict, names: list[str]
) -> None:
    engine = llm.llm_engine
    engine.add_request("good", PROMPT, SamplingParams(max_tokens=5, guided_decoding=GUIDED))
    with pytest.raises(ValueError) as info:
        engine.add_request(
            "bad", PROMPT, SamplingParams(guided_decoding=GuidedDecodingParams(**spec))
        )
    for name in names:
        assert name in str(info.value)
    assert "/project/" not in str(info.value)  # no C++ source locations
    final = run_to_end(engine)
    assert list(final) == ["good"] and final["good"].outputs[0].finish_reason == "length"
    assert_pool_clean(engine)


def test_equal_specs_compile_once(llm: LLM) -> None:
    cache = llm.llm_engine.grammar_cache()
    before = cache.num_compiles
    reordered = json.loads(json.dumps(SCHEMA))
    reordered = {k: reordered[k] for k in reversed(list(reordered))}
    for spec in (SCHEMA, reordered, json.dumps(SCHEMA, indent=2)):
        llm.generate(
            PROMPT, SamplingParams(max_tokens=2, guided_decoding=GuidedDecodingParams(json=spec))
        )
    assert cache.num_compiles - before <= 1


def slow_compiles(monkeypatch: pytest.MonkeyPatch, delay_s: float) -> None:
    real = GrammarCompileCache._compile

    def slow(self: GrammarCompileCache, spec: GuidedDecodingParams) -> Any:
        time.sleep(delay_s)
        return real(self, spec)

    monkeypatch.setattr(GrammarCompileCache, "_compile", slow)


def test_others_run_while_a_grammar_compiles(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    slow_compiles(monkeypatch, 0.6)
    engine = llm.llm_engine
    regex = GuidedDecodingParams(regex=r"slow-[0-9]{3}")  # a spec no other test compiled
    engine.add_request("guided", PROMPT, SamplingParams(max_tokens=20, guided_decoding=regex))
    engine.add_request("plain", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    first = {o.request_id: o for o in engine.step()}
    assert "plain" in first and "guided" not in first  # not aborted, not blocking either
    final = run_to_end(engine)
    assert final["plain"].outputs[0].finish_reason == "length"
    assert re.fullmatch(r"slow-[0-9]{3}", final["guided"].outputs[0].text)
    assert_pool_clean(engine)


def test_a_grammar_that_compiles_too_long_is_refused(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_compiles(monkeypatch, 1.5)
    engine = llm.llm_engine
    monkeypatch.setattr(engine, "grammar_timeout_s", 0.2)
    regex = GuidedDecodingParams(regex=r"late-[a-z]{4}")
    engine.add_request("late", PROMPT, SamplingParams(max_tokens=20, guided_decoding=regex))
    engine.add_request("plain", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    final = run_to_end(engine)
    late = final["late"]
    assert late.outputs[0].finish_reason == "error" and late.outputs[0].token_ids == []
    assert "did not compile within 0.2 s" in (late.error or "")
    assert "TOKENWISE_GRAMMAR_COMPILE_TIMEOUT_S" in (late.error or "")
    assert final["plain"].error is None and len(final["plain"].outputs[0].token_ids) == 30
    assert_pool_clean(engine)


def test_padding_ids_beyond_the_tokenizer_are_never_sampled(tmp_path) -> None:
    vocab = TOKENIZER_VOCAB_SIZE + 40
    path = build_tiny_checkpoint(tmp_path, vocab_size=vocab)
    llm = LLM(path, dtype="float32", device="cpu", num_gpu_blocks=64)
    anything = GuidedDecodingParams(regex=r"[a-z ]{1,30}")

    def tokens(guided: GuidedDecodingParams | None) -> torch.Tensor:
        params = [SamplingParams(temperature=1.5, seed=i, max_tokens=12, ignore_eos=True,
                                 guided_decoding=guided) for i in range(12)]  # fmt: skip
        outs = llm.generate(["The cat"] * 12, params, use_tqdm=False)
        return torch.tensor([t for o in outs for t in o.outputs[0].token_ids])

    assert (tokens(None) >= TOKENIZER_VOCAB_SIZE).any()  # the random model likes them
    assert (tokens(anything) < TOKENIZER_VOCAB_SIZE).all()


def test_guided_decoding_needs_a_tokenizer(tmp_path) -> None:
    path = build_tiny_checkpoint(tmp_path)
    llm = LLM(path, dtype="float32", device="cpu", num_gpu_blocks=64, skip_tokenizer_init=True)
    params = SamplingParams(guided_decoding=GuidedDecodingParams(regex="a+"))
    with pytest.raises(ValueError, match="guided_decoding needs a tokenizer"):
        llm.llm_engine.add_request("r", [5, 6, 7], params)
