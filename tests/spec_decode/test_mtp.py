"""MTP speculation (DeepSeek-V3's multi-token-prediction module) through the whole engine.

The target checkpoints carry the module as DeepSeek ships it (`mtp_checkpoints.py`); the
target loads without it and transformers ignores it, so HF's greedy output is the reference.
Greedy output with a noisy MTP module must be HF's under every scheduling; a copying module on
a counting target must get its drafts accepted; a checkpoint without the module, or a target
that is not DeepSeek, is an error naming what is missing.
"""

from __future__ import annotations

import tempfile
from functools import cache
from typing import Any

import pytest

from tests.engine._fixtures import (
    LLAMA,
    NUM_BLOCKS,
    _tmp_dir,
    assert_pool_clean,
    checkpoint,
    hf_greedy,
    mixed_prompts,
)
from tests.spec_decode.mtp_checkpoints import deepseek_with_mtp, without_mtp_layers
from tests.spec_decode.test_eagle import MAX_TOKENS, PARITY_IDS, PARITY_SETTINGS, generate
from tokenwise import LLM


@cache
def target(counting: bool = False) -> str:
    return deepseek_with_mtp(tempfile.mkdtemp(dir=_tmp_dir()), counting=counting)


@cache
def hf_refs(path: str) -> list[list[int]]:
    return [hf_greedy(path, p, MAX_TOKENS) for p in mixed_prompts()]


def make_llm(path: str, **overrides: Any) -> LLM:
    kwargs: dict[str, Any] = {"dtype": "float32", "num_gpu_blocks": NUM_BLOCKS, "seed": 0}
    kwargs.update(overrides)
    spec = {"method": "mtp", "num_speculative_tokens": 3, "disable_by_batch_size": 64}
    return LLM(path, speculative_config=spec, **kwargs)


@pytest.mark.parametrize("config", PARITY_SETTINGS, ids=PARITY_IDS)
def test_greedy_with_mtp_equals_hf(config: dict[str, Any]) -> None:
    path, prompts = target(), mixed_prompts()
    llm = make_llm(path, **config)
    assert generate(llm, prompts) == hf_refs(path)
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_drafts > 0
    assert stats.generation_tokens_total == len(prompts) * MAX_TOKENS
    assert_pool_clean(llm.llm_engine)
    if not config:  # again, with the prompts' blocks served from the prefix cache
        assert generate(llm, prompts) == hf_refs(path)
        assert llm.llm_engine.get_stats().prefix_cache_hits > 0
        assert_pool_clean(llm.llm_engine)


def test_a_copying_mtp_module_is_accepted() -> None:
    """Every draft of the copying module is the counting target's next token, except where
    the module reads position 0 (its embedding is zeroed there, as in vLLM): a 1-token
    prompt's first draft."""
    path, prompts = target(counting=True), mixed_prompts()
    llm = make_llm(path)
    assert generate(llm, prompts) == hf_refs(path)
    stats = llm.llm_engine.get_stats()
    one_token_prompts = sum(len(p) == 1 for p in prompts)
    drafted, accepted = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
    assert drafted > 3 * len(prompts)
    assert stats.spec_decode_num_accepted_tokens_per_pos[0] >= (
        stats.spec_decode_num_drafts - one_token_prompts
    )
    assert accepted >= drafted - 3 * one_token_prompts
    assert_pool_clean(llm.llm_engine)


def test_mtp_needs_the_module_and_a_deepseek_target() -> None:
    bare = deepseek_with_mtp(tempfile.mkdtemp(dir=_tmp_dir()), seed=1)
    with pytest.raises(ValueError, match="num_nextn_predict_layers >= 1.* is 0"):
        make_llm(without_mtp_layers(bare))
    with pytest.raises(
        ValueError, match="'mtp' runs the MTP module of DeepSeek-V3.*; the target is"
    ):
        make_llm(checkpoint(LLAMA))
    with pytest.raises(ValueError, match="speculative_config.model must be a checkpoint dir"):
        LLM(
            target(),
            speculative_config={"method": "mtp", "model": "./nope", "num_speculative_tokens": 2},
        )
