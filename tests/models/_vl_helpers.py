"""Helpers the vision-language parity tests share: prompts with generated images, greedy
tokens cut at EOS, and a spy on where the scheduler ends each prefill chunk."""

from __future__ import annotations

from typing import Any

from tests.models._tiny_llava import make_image

Specs = tuple[tuple[int, int, int], ...]


def strip_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def engine_prompt(prompt: str, specs: Specs) -> Any:
    """vLLM's prompt form with one generated image per spec (seed, width, height)."""
    if not specs:
        return prompt
    images = [make_image(*s) for s in specs]
    return {"prompt": prompt, "multi_modal_data": {"image": images}}


def chunk_ends(llm: Any) -> list[tuple[int, list[tuple[int, int]]]]:
    """Spy on the scheduler: where each scheduled chunk ends, and its request's images."""
    seen: list[tuple[int, list[tuple[int, int]]]] = []
    sched = llm.llm_engine.scheduler
    original = sched.limit_chunk

    def spy(request: Any, num_computed: int, num_new: int) -> int:
        n = original(request, num_computed, num_new)
        if n > 0:
            seen.append((num_computed + n, [(im.offset, im.end) for im in request.images]))
        return n

    sched.limit_chunk = spy
    return seen
