"""argparse `type` functions for engine flags: sizes, bounded integers, JSON objects.

Apart from `engine_args` (where each setting is declared) because they are parsing, not
settings: the server's and the benchmarks' own flags use them too. Only the standard library
is imported at module level, so building a parser stays instant (no torch, no engine).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)


def parse_memory_size(text: str) -> int:
    """Bytes from '1073741824', '512MiB', '2GB' or '1.5g' (binary units for the 'i' forms)."""
    match = _SIZE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use bytes or a unit such as 512MiB or 2GiB"
        )
    number = float(match.group(1))
    unit = (match.group(2) or "").lower().rstrip("b")  # "mib" -> "mi", "gb" -> "g"
    scale = 1
    if unit:
        power = "kmgt".index(unit[0]) + 1
        scale = 1024**power if unit.endswith("i") else 1000**power
    value = int(number * scale)
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def bounded_int(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse `type` accepting integers in [minimum, maximum] with a one-line error."""
    span = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer {span}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected an integer {span}, got {value}")
        return value

    return parse


positive_int = bounded_int(1)
non_negative_int = bounded_int(0)


def parse_json_dict(text: str) -> dict[str, Any]:
    """An argparse `type` for a JSON object flag (`--limit-mm-per-prompt '{"image": 2}'`)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def parse_cudagraph_mode(text: str) -> str:
    """A `CUDAGraphMode` name, any case; the error lists the valid names."""
    from tokenwise.config import CUDAGraphMode

    try:
        return CUDAGraphMode.parse(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_capture_sizes(text: str) -> list[int]:
    """Comma-separated token counts >= 1, e.g. '1,2,4,8,16'."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers >= 1 such as 1,2,4,8, got {text!r}"
        )
    return sorted(set(sizes))


def parse_kv_events_config(text: str) -> Any:
    """A `KVEventsConfig` from JSON such as '{"enable_kv_cache_events": true}'."""
    from tokenwise.kv_cache.events_config import KVEventsConfig

    try:
        return KVEventsConfig.from_cli(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"invalid --kv-events-config {text!r}: {e}") from None


def parse_speculative_config(text: str) -> Any:
    """A `SpeculativeConfig` from JSON such as '{"method": "ngram", "num_speculative_tokens": 4}'."""
    import json

    from tokenwise.config import SpeculativeConfig

    try:
        return SpeculativeConfig.from_dict(json.loads(text))
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(
            f"invalid speculative config {text!r} ({e}); expected JSON such as "
            '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\''
        ) from None


def parse_pooler_config(text: str) -> Any:
    """A `PoolerConfig` from JSON such as '{"pooling_type": "MEAN", "normalize": false}'."""
    import json

    from tokenwise.config import PoolerConfig

    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("expected a JSON object")
        return PoolerConfig(**fields)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(
            f"invalid pooler config {text!r} ({e}); expected JSON such as "
            '\'{"pooling_type": "MEAN", "normalize": true}\''
        ) from None
