"""Shared CLI flag parsing: sizes, bounded integers, and the flags-to-LLM-kwargs mapping."""

from __future__ import annotations

import argparse

import pytest

from tokenwise.entrypoints.engine_args import (
    add_engine_args,
    bounded_int,
    engine_kwargs,
    parse_memory_size,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1073741824", 1073741824),
        ("512MiB", 512 * 1024**2),
        ("2GiB", 2 * 1024**3),
        ("2GB", 2 * 1000**3),
        ("1.5g", 1_500_000_000),
        ("64k", 64_000),
        ("8 MiB", 8 * 1024**2),
    ],
)
def test_memory_sizes(text: str, expected: int) -> None:
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "-5MiB", "0", "1XB", ""])
def test_bad_memory_sizes_are_argparse_errors(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="invalid size|size must be positive"):
        parse_memory_size(text)


def test_bounded_int() -> None:
    port = bounded_int(1, 65535)
    assert port("8000") == 8000
    for bad in ("0", "65536", "eighty"):
        with pytest.raises(argparse.ArgumentTypeError, match="1..65535"):
            port(bad)
    with pytest.raises(argparse.ArgumentTypeError, match=">= 0"):
        bounded_int(0)("-1")


def test_engine_flags_map_to_llm_kwargs() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        [
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "1MiB",
            "--max-num-seqs",
            "3",
            "--no-enable-prefix-caching",
            "--compile",
            "--max-num-encoder-input-tokens",
            "64",
        ]
    )
    kwargs = engine_kwargs(args)
    assert kwargs["max_num_encoder_input_tokens"] == 64
    assert kwargs["dtype"] == "float32"
    assert kwargs["kv_cache_memory"] == 1 << 20
    assert kwargs["max_num_seqs"] == 3
    assert kwargs["enable_prefix_caching"] is False
    assert kwargs["enforce_eager"] is False
    defaults = engine_kwargs(parser.parse_args([]))
    assert defaults["enforce_eager"] is None  # decided per device
    assert defaults["enable_prefix_caching"] is True
    assert defaults["max_num_encoder_input_tokens"] is None  # max_num_batched_tokens
    assert parser.parse_args(["--enforce-eager"]).enforce_eager is True
