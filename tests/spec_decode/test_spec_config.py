"""`speculative_config`: vLLM's JSON form, defaults, and errors that name the field."""

from __future__ import annotations

import argparse

import pytest

from tokenwise.config import SpeculativeConfig
from tokenwise.entrypoints.engine_args import parse_speculative_config


def test_ngram_defaults_and_method_inference() -> None:
    cfg = SpeculativeConfig.from_dict({"num_speculative_tokens": 4})
    assert (cfg.method, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 1, 5)
    cfg = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 7}
    )
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (7, 7)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"num_speculative_tokens": 2, "method": "medusa"}, "method must be one of"),
        ({"num_speculative_tokens": 2, "model": "./no-such-draft"}, "model must be a checkpoint"),
        ({"num_speculative_tokens": 2, "method": "draft_model"}, "model is required"),
        ({"num_speculative_tokens": 2, "method": "ngram", "model": "."}, "model applies to"),
        (
            {"num_speculative_tokens": 2, "model": ".", "prompt_lookup_max": 3},
            "prompt_lookup_max applies to method 'ngram'",
        ),
        (
            {"num_speculative_tokens": 2, "method": "mtp", "prompt_lookup_min": 2},
            "prompt_lookup_min applies to method 'ngram', not 'mtp'",
        ),
        ({"num_speculative_tokens": 2, "lookup_max": 3}, "unknown field\\(s\\) lookup_max"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min must be <= prompt_lookup_max",
        ),
        ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_configs_name_the_field(fields: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(fields)


def test_the_cli_flag_parses_json_and_explains_errors() -> None:
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert cfg.num_speculative_tokens == 3
    with pytest.raises(argparse.ArgumentTypeError, match="invalid speculative config"):
        parse_speculative_config("{not json")
    with pytest.raises(argparse.ArgumentTypeError, match="prompt_lookup_max"):
        parse_speculative_config(
            '{"num_speculative_tokens": 3, "prompt_lookup_min": 3, "prompt_lookup_max": 1}'
        )


def test_suffix_defaults_follow_vllm() -> None:
    cfg = SpeculativeConfig.from_dict({"method": "suffix"})
    assert cfg.num_speculative_tokens == cfg.suffix_decoding_max_tree_depth == 24
    assert (cfg.suffix_decoding_max_cached_requests, cfg.suffix_decoding_max_spec_factor) == (
        100,
        1.0,
    )
    assert cfg.suffix_decoding_min_token_prob == 0.1
    cfg = SpeculativeConfig.from_dict(
        {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 12}
    )
    assert (cfg.num_speculative_tokens, cfg.suffix_decoding_max_tree_depth) == (8, 12)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"suffix_decoding_max_tree_depth": 1}, "suffix_decoding_max_tree_depth must be"),
        ({"suffix_decoding_max_cached_requests": -1}, "max_cached_requests must be an integer"),
        ({"suffix_decoding_max_spec_factor": 0}, "max_spec_factor must be a number > 0"),
        ({"suffix_decoding_min_token_prob": 1.5}, "min_token_prob must be a number in \\[0, 1\\]"),
        ({"prompt_lookup_max": 3}, "prompt_lookup_max applies to method 'ngram', not 'suffix'"),
        ({"model": "."}, "model does not apply to method 'suffix'"),
    ],
)
def test_bad_suffix_settings_name_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict({"method": "suffix", **fields})


def test_suffix_settings_for_another_method_are_refused() -> None:
    with pytest.raises(ValueError, match="suffix_decoding_max_tree_depth applies to method"):
        SpeculativeConfig.from_dict(
            {"num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8}
        )
