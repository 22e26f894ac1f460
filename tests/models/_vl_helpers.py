"""Helpers the vision-language parity tests share: prompts with generated images, greedy
tokens cut at EOS, a spy on where the scheduler ends each prefill chunk, and the prefix-cache
walk through and into an image."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.engine._fixtures import assert_pool_clean
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


def check_prefix_hits_through_and_into_image(
    llm: Any,
    case: tuple[str, Specs],
    tail: tuple[str, Specs],
    reference: Callable[[str, Specs], list[int]],
    params: Any,
    block_size: int = 8,
) -> None:
    """`case` (one image) twice: the second run hits every full block, through the image, and
    encodes nothing. Then `tail` (the same image, other text right after it): the hit ends
    inside the image, whose cached K/V were computed with the whole image. Every answer is
    `reference`'s (HF's greedy tokens)."""
    engine = llm.llm_engine
    first = llm.generate(engine_prompt(*case), params, use_tqdm=False)[0]
    again = llm.generate(engine_prompt(*case), params, use_tqdm=False)[0]
    n = len(first.prompt_token_ids)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (n - 1) // block_size * block_size
    eos = engine.eos_token_ids[0]
    assert strip_eos(list(again.outputs[0].token_ids), eos) == reference(*case)
    assert engine.runner.kind_part.num_encoder_runs == 1  # the hit covered the image
    image_id = engine.kind.image_token_id
    offset = first.prompt_token_ids.index(image_id)
    length = first.prompt_token_ids.count(image_id)
    third = llm.generate(engine_prompt(*tail), params, use_tqdm=False)[0]
    assert offset < third.num_cached_tokens < offset + length
    assert strip_eos(list(third.outputs[0].token_ids), eos) == reference(*tail)
    assert_pool_clean(engine)
