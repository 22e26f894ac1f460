"""Engine settings of a vision-language model, checked once when the engine is configured.

Kept apart from the kind so the configuration code (`entrypoints/engine_config.py`) can read them
without importing the engine: images run on one rank, eagerly (`multimodal_runner.py` says
why), and `limit_mm_per_prompt` (vLLM's `{"image": N, "video": M}`) must name modalities this engine
reads, with non-negative counts.
"""

from __future__ import annotations

from typing import Any

MODALITIES = ("image", "video")  # video: Qwen3.5 only (others refuse a video by name)


def parse_limit_mm_per_prompt(limit: Any) -> dict[str, int] | None:
    """`{"image": N}` checked (None: no limit); a clear ValueError otherwise."""
    if limit is None:
        return None
    if not isinstance(limit, dict):
        raise ValueError(
            f'limit_mm_per_prompt must be a dict such as {{"image": 2}}, got {limit!r}'
        )
    out: dict[str, int] = {}
    for key, value in limit.items():
        if key not in MODALITIES:
            raise ValueError(
                f"limit_mm_per_prompt names {key!r}; the modalities are {', '.join(MODALITIES)}"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"limit_mm_per_prompt[{key!r}] must be an integer >= 0, got {value!r}")
        out[key] = value
    return out
