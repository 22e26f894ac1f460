"""The second KV tier in the engine: blocks evicted from a small pool come back from the tier
with the same greedy tokens as a cold run, fp8 caches and sliding windows included; a restart
serves the files a previous engine left; damaged files are misses; every block is free at the
end; and the engines the tier does not support are refused by name.

One conversation pattern throughout: four 100-token prompts A, B, C, D over a 16-block pool
(a prompt and its answer take 7 blocks), run A B C A D B, so that A's and B's cached blocks
are evicted by the traffic in between and a returning prompt has to find them in the tier.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.engine._fixtures import LLAMA, assert_pool_clean, checkpoint
from tests.engine._kv_tier_turns import PARAMS, SMALL
from tests.engine._kv_tier_turns import prompts as _prompts
from tests.engine._kv_tier_turns import run_turns as _run
from tokenwise import LLM
from tokenwise.engine.stats import EngineStats
from tokenwise.entrypoints.openai.metrics import _EngineCollector
from tokenwise.entrypoints.openai.metrics_aliases import VllmAliasCollector


@pytest.fixture(scope="module")
def cold() -> list[list[int]]:
    return _run(LLM(checkpoint(LLAMA), enable_prefix_caching=False, **SMALL))


def _tiered(path: str, directory: Path, **kwargs: Any) -> LLM:
    settings = SMALL | {"kv_offloading_size": 0.01, "kv_offloading_dir": str(directory)}
    return LLM(path, **(settings | kwargs))


def test_tier_hits_give_the_cold_run_tokens(cold: list, tmp_path: Path) -> None:
    llm = _tiered(checkpoint(LLAMA), tmp_path)
    assert _run(llm) == cold
    engine = llm.llm_engine
    stats = engine.get_stats()
    # A's second turn: 6 full blocks, 3 still in the pool and 3 back from disk; B's: all 6
    # from disk. Each turn's lookup saw its whole prefix.
    assert stats.prefix_cache_tier_hits == (3 + 6) * 16
    assert stats.prefix_cache_hits == (6 + 6) * 16
    assert engine.kv_tier.store.stats.stored >= 9 and engine.kv_tier.store.stats.corrupt == 0
    assert_pool_clean(engine)
    text = _metrics(stats)
    assert 'prefix_cache_hits_by_tier_total{model_name="m",tier="disk"} 144.0' in text
    assert 'prefix_cache_hits_by_tier_total{model_name="m",tier="kv_cache"} 48.0' in text
    assert 'vllm:external_prefix_cache_hits_total{model_name="m"} 144.0' in text
    assert 'tokenwise:external_prefix_cache_hits_total{model_name="m"} 144.0' in text


def _metrics(stats: EngineStats) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    collector = _EngineCollector("m", lambda: stats, dict)
    registry.register(collector)
    registry.register(VllmAliasCollector([collector]))
    return generate_latest(registry).decode()


def test_restart_serves_old_files_and_damaged_files_are_misses(cold: list, tmp_path: Path) -> None:
    first = tmp_path / "first"
    llm = _tiered(checkpoint(LLAMA), first)
    engine = llm.llm_engine
    prompts = _prompts()
    for i in (0, 1, 2, 3):  # all of A's blocks end up on disk
        engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, PARAMS)
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.kv_tier.store.flush(30)
    engine.shutdown()
    damaged = tmp_path / "damaged"
    shutil.copytree(first, damaged)
    files = list(damaged.rglob("*.kv"))
    assert files
    for f in files:  # one flipped byte each, in the payload
        data = bytearray(f.read_bytes())
        data[-5] ^= 0xFF
        f.write_bytes(bytes(data))

    restarted = _tiered(checkpoint(LLAMA), first)
    assert _run(restarted, (0,)) == [cold[0]]
    assert restarted.llm_engine.get_stats().prefix_cache_tier_hits == 6 * 16

    bad = _tiered(checkpoint(LLAMA), damaged)
    assert _run(bad, (0,)) == [cold[0]]
    engine = bad.llm_engine
    assert engine.get_stats().prefix_cache_tier_hits == 0
    assert engine.kv_tier.store.stats.corrupt >= 1
    assert_pool_clean(engine)


def test_fp8_cache_through_the_tier_matches_fp8_kept_in_the_pool(tmp_path: Path) -> None:
    """A block's fp8 bytes go out and come back unchanged: the same tokens as an fp8 engine
    whose pool is large enough to keep every block."""
    path = checkpoint(LLAMA)
    big = _run(LLM(path, kv_cache_dtype="fp8", **(SMALL | {"num_gpu_blocks": 128})))
    llm = _tiered(path, tmp_path, kv_cache_dtype="fp8")
    assert _run(llm) == big
    assert llm.llm_engine.get_stats().prefix_cache_tier_hits > 0
    assert_pool_clean(llm.llm_engine)


def test_sliding_window_groups_through_the_tier(tmp_path: Path) -> None:
    """A tiny Gemma 3 (full and sliding-window groups, window 8): both groups' blocks are
    evicted, stored under their group's keys and loaded back."""
    path = checkpoint("Gemma3ForCausalLM")
    settings = {"num_gpu_blocks": 24, "max_model_len": 128, "max_num_batched_tokens": 32}
    ref = _run(LLM(path, enable_prefix_caching=False, **(SMALL | settings)))
    llm = _tiered(path, tmp_path, **settings)
    assert _run(llm) == ref
    engine = llm.llm_engine
    kinds = [m.spec.kind for m in engine.block_manager.managers]
    assert kinds == ["full"] + ["sliding_window"] * 3
    # Both returning turns hit 6 blocks, all from the tier: 6 full-attention blocks each,
    # and one window block in each of the three sliding groups.
    assert engine.get_stats().prefix_cache_tier_hits == 2 * 6 * 16
    assert engine.kv_tier.num_loaded == 2 * (6 + 3)
    assert_pool_clean(engine)


def test_reset_prefix_cache_empties_the_tier(tmp_path: Path) -> None:
    llm = _tiered(checkpoint(LLAMA), tmp_path, kv_offloading_backend="cpu")
    _run(llm, (0, 1, 2))
    store = llm.llm_engine.kv_tier.store
    assert store.name == "cpu" and store.stats.bytes_used > 0
    assert llm.llm_engine.reset_prefix_cache()
    assert store.stats.bytes_used == 0


def test_tier_without_prefix_caching_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="prefix caching is off"):
        _tiered(checkpoint(LLAMA), tmp_path, enable_prefix_caching=False)
