"""SamplingParams: vLLM-compatible defaults, normalisation and validation messages."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tokenwise.sampling import SamplingMetadata, SamplingParams, SamplingType, make_generator


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert p.seed is None
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.logprobs is None
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.ignore_eos is False and p.include_stop_str_in_output is False
    assert p.skip_special_tokens is True and p.spaces_between_special_tokens is True
    assert p.stop == [] and p.stop_token_ids == []
    assert p.sampling_type is SamplingType.RANDOM


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
        # Beyond what torch.Generator.manual_seed takes (sample i of n is seeded with seed + i).
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"n": 3, "seed": 2**64 - 2}, "seed"),
        # Wrong types must be rejected, not silently coerced.
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"n": True}, "n"),
        ({"top_k": False}, "top_k"),
        ({"max_tokens": True}, "max_tokens"),
        ({"n": 2.0}, "n"),
        ({"stop": 5}, "stop"),
    ],
)
def test_invalid_values_name_the_parameter(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(name + " ")
    # The offending value is echoed back so the user can find it.
    given = kwargs[name]
    assert repr(given) in message or str(given) in message


def test_top_p_message_states_range_and_value() -> None:
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 1\.5$"):
        SamplingParams(top_p=1.5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0, "top_k": 0, "min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"max_tokens": None, "min_tokens": 1000},
        {"min_tokens": 16, "max_tokens": 16},
        {"logprobs": 0},
        {"repetition_penalty": 0.5},
        {"stop_token_ids": [0, 7]},
        {"temperature": 2},
        {"seed": 2**64 - 1},
        {"seed": -(2**63)},
        {"n": 3, "seed": 2**64 - 3},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, Any]) -> None:
    p = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(p, key) == value


@pytest.mark.parametrize(("n", "seed"), [(1, -(2**63)), (1, 2**64 - 1), (4, 2**64 - 4)])
def test_every_accepted_seed_seeds_a_generator(n: int, seed: int) -> None:
    """The range checked is torch's: each sample's seed (seed + i) must seed a generator, which
    fails on an out-of-range seed with "Overflow when unpacking long long" (what a request with
    seed=2**64 got back, as a 400 about its prompt, before the check)."""
    params = SamplingParams(n=n, seed=seed)
    for i in range(params.n):
        # torch keeps the seed as an unsigned 64-bit number: negative seeds wrap around.
        assert make_generator(seed + i).initial_seed() == (seed + i) % 2**64


def test_top_k_minus_one_normalised_to_off() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


def test_stop_normalised_to_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(2, 3)).stop_token_ids == [2, 3]


def test_int_temperature_is_stored_as_float() -> None:
    assert isinstance(SamplingParams(temperature=1).temperature, float)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"temperature": 0.0}, SamplingType.GREEDY),
        ({"temperature": 5e-6}, SamplingType.GREEDY),
        ({"temperature": 0.0, "seed": 3}, SamplingType.GREEDY),
        ({"temperature": 1e-4}, SamplingType.RANDOM),
        ({"temperature": 0.7, "seed": 0}, SamplingType.RANDOM_SEED),
        ({}, SamplingType.RANDOM),
    ],
)
def test_sampling_type(kwargs: dict[str, Any], expected: SamplingType) -> None:
    assert SamplingParams(**kwargs).sampling_type is expected


def test_clone_does_not_alias_lists() -> None:
    original = SamplingParams(stop=["x"], stop_token_ids=[1])
    copy = original.clone()
    assert copy == original
    copy.stop.append("y")  # type: ignore[union-attr]
    copy.stop_token_ids.append(2)  # type: ignore[union-attr]
    assert original.stop == ["x"] and original.stop_token_ids == [1]


def test_metadata_leaves_unused_knobs_out() -> None:
    meta = SamplingMetadata.from_params(
        [SamplingParams(), SamplingParams(temperature=0.0)], [None, None]
    )
    assert (meta.top_k, meta.top_p, meta.min_p) == (None, None, None)
    assert meta.no_penalties and meta.max_num_logprobs is None
    assert meta.greedy_mask.tolist() == [False, True]
    assert not meta.all_greedy and not meta.all_random


def test_metadata_rows_and_generators() -> None:
    seeded, greedy_seeded = make_generator(1), make_generator(2)
    params = [
        SamplingParams(top_k=5, seed=1, logprobs=2),
        SamplingParams(temperature=0.0, seed=2, top_p=0.9),
        SamplingParams(temperature=0.5, logprobs=4, top_k=500, repetition_penalty=1.2),
    ]
    meta = SamplingMetadata.from_params(params, [seeded, greedy_seeded, None], vocab_size=100)
    assert meta.top_k is not None and meta.top_k.tolist() == [5, 100, 100]
    assert meta.top_p is not None and meta.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0])
    # Greedy rows never draw noise, so only the random seeded row keeps its generator.
    assert meta.generators == {0: seeded}
    assert meta.temperature.dtype == torch.float32
    assert meta.temperature.tolist() == [1.0, 1.0, 0.5]
    assert meta.max_num_logprobs == 4
    assert meta.repetition_penalties is not None and meta.presence_penalties is None
    assert meta.output_token_ids == [[], [], []]


def test_generator_from_same_seed_repeats_its_stream() -> None:
    a = torch.empty(8).exponential_(generator=make_generator(42))
    b = torch.empty(8).exponential_(generator=make_generator(42))
    c = torch.empty(8).exponential_(generator=make_generator(43))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: -101}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {"five": 1.0}}, "logit_bias"),
        ({"logit_bias": {"²": 1.0}}, "logit_bias"),
        ({"logit_bias": {"--5": 1.0}}, "logit_bias"),
        ({"logit_bias": {-3: 1.0}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"allowed_token_ids": [1.0]}, "allowed_token_ids"),
        ({"bad_words": ["ok", " "]}, "bad_words"),
        ({"bad_words": [3]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"best_of": 2}, "best_of"),
        ({"n": 3, "best_of": 4}, "best_of"),
        ({"best_of": 1.0}, "best_of"),
    ],
)
def test_invalid_request_fields_name_the_parameter(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} "):
        SamplingParams(**kwargs)


def test_request_field_values_that_are_accepted() -> None:
    p = SamplingParams(
        n=2,
        best_of=2,
        prompt_logprobs=0,
        logit_bias={"7": -100, 9: 100.0},  # JSON keys are strings
        allowed_token_ids=(3, 4),
        bad_words="no",
        truncate_prompt_tokens=-1,
    )
    assert p.logit_bias == {7: -100, 9: 100.0}
    assert p.allowed_token_ids == [3, 4] and p.bad_words == ["no"]
    assert p.has_logits_processors and not SamplingParams().has_logits_processors
    assert SamplingParams(truncate_prompt_tokens=1).truncate_prompt_tokens == 1
    with pytest.raises(RuntimeError, match="resolve_bad_words"):
        _ = p.bad_words_token_ids  # tokenized by the engine, which has the tokenizer
