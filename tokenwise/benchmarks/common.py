"""Pieces every benchmark shares: workload flags and generation, statistics, JSON output.

Kept free of torch so that `tokenwise bench --help` and argument errors are instant.

The workload is random token ids from a seeded `random.Random`, so two engines (or two runs)
given the same seed see byte-identical prompts and output lengths, and no tokenizer is needed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenwise.entrypoints.engine_args import positive_int


def parse_len_range(text: str) -> tuple[int, int]:
    """`MIN:MAX` (inclusive) or a single `N` meaning `N:N`; an argparse `type=`."""
    parts = str(text).split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX or N, got {text!r}") from None
    if lo < 1:
        raise argparse.ArgumentTypeError(f"lengths must be at least 1, got {text!r}")
    if lo > hi:
        raise argparse.ArgumentTypeError(f"MIN must not exceed MAX, got {text!r}")
    return lo, hi


def add_workload_args(parser: argparse.ArgumentParser, input_len: int, output_len: int) -> None:
    """`--input-len N` or `--random-input-len MIN:MAX` (and the same for output)."""
    g = parser.add_argument_group("workload")
    lengths = g.add_mutually_exclusive_group()
    lengths.add_argument(
        "--input-len",
        type=positive_int,
        default=input_len,
        help=f"prompt tokens per request (default: {input_len})",
    )
    lengths.add_argument(
        "--random-input-len",
        type=parse_len_range,
        default=None,
        metavar="MIN:MAX",
        help="prompt lengths uniform in MIN..MAX (seeded by --seed)",
    )
    out = g.add_mutually_exclusive_group()
    out.add_argument(
        "--output-len",
        type=positive_int,
        default=output_len,
        help=f"generated tokens per request (default: {output_len})",
    )
    out.add_argument(
        "--random-output-len",
        type=parse_len_range,
        default=None,
        metavar="MIN:MAX",
        help="output lengths uniform in MIN..MAX (seeded by --seed)",
    )


def length_ranges(args: argparse.Namespace) -> tuple[tuple[int, int], tuple[int, int]]:
    inputs = args.random_input_len or (args.input_len, args.input_len)
    outputs = args.random_output_len or (args.output_len, args.output_len)
    return inputs, outputs


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: its prompt and how many tokens it must generate."""

    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def make_workload(
    num_prompts: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """`num_prompts` requests with lengths uniform in the inclusive ranges, deterministic in
    `seed`. Token ids are uniform over the whole vocabulary: with ignore-EOS and random weights
    their values do not change the cost, and a real tokenizer is not needed."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be at least 1, got {vocab_size}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        prompt_len = rng.randint(*input_range)
        output_len = rng.randint(*output_range)
        ids = [rng.randrange(vocab_size) for _ in range(prompt_len)]
        requests.append(BenchRequest(ids, output_len))
    return requests


def percentile(values: Sequence[float], pct: float) -> float:
    """Linear-interpolation percentile (numpy's default), without needing numpy."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float], pcts: Iterable[float] = (50, 90, 99)) -> dict[str, float]:
    """mean, median and the requested percentiles (`p50`, `p90`...) of `values`."""
    out = {
        "mean": statistics.fmean(values) if values else math.nan,
        "median": statistics.median(values) if values else math.nan,
    }
    for pct in pcts:
        out[f"p{pct:g}"] = percentile(values, pct)
    return out


def _json_safe(value: Any) -> Any:
    """NaN (a statistic of no samples) becomes null: strict JSON parsers reject NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: str | None, data: dict[str, Any]) -> None:
    """Write the results where `--output-json` asked (no-op without a path)."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump(_json_safe(data), f, indent=2, sort_keys=True)
        f.write("\n")


def check_model_dir(model: str | None) -> None:
    """The engine says the same, but only after importing torch; fail fast on a typo."""
    if model is not None and not os.path.isdir(model):
        raise FileNotFoundError(f"model directory {model!r} does not exist")


def check_fits(input_range: tuple[int, int], output_len_max: int, max_model_len: int) -> None:
    """Fail before the run, not halfway through it, when a request cannot fit the context."""
    longest = input_range[1] + output_len_max
    if longest > max_model_len:
        raise ValueError(
            f"the longest request needs {input_range[1]} prompt + {output_len_max} output = "
            f"{longest} tokens, but max_model_len is {max_model_len}; shorten the lengths or "
            "raise --max-model-len"
        )
