"""Checks the configuration dataclasses share (`config.py`, `speculative_config.py`)."""

from __future__ import annotations

from typing import Any


def check_int(name: str, value: Any, minimum: int) -> None:
    """Raise ValueError naming `name` unless `value` is an integer (not a bool) >= `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
