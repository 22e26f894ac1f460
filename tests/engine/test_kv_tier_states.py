"""Recurrent-state snapshots in the second KV tier: a tiny Qwen3.5 (Gated DeltaNet layers and
one full-attention layer, fp32) whose state slots are too few to keep every prompt's snapshot.

The pattern of `_kv_tier_turns.py`: four 100-token prompts run A B C A D B over a 16-block pool
and 4 state slots (`max_num_seqs=2`: two live states, two snapshots), so A's and B's attention
blocks and one of their snapshots are evicted before they return. A hybrid's prefix hit needs
both the attention blocks and the state snapshot after the hit's last block; a hit that the
tier serves therefore proves both came back, and its greedy tokens must equal a cold run's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.engine._fixtures import assert_pool_clean, checkpoint
from tests.engine._kv_tier_turns import SMALL as TURNS_SMALL
from tests.engine._kv_tier_turns import run_turns as _run
from tokenwise import LLM

SMALL = TURNS_SMALL | {"max_num_seqs": 2}
BS = 16


@pytest.fixture(scope="module")
def model() -> str:
    return checkpoint("Qwen3_5ForCausalLM")


@pytest.fixture(scope="module")
def cold(model: str) -> list[list[int]]:
    return _run(LLM(model, enable_prefix_caching=False, **SMALL))


@pytest.fixture(scope="module")
def tiered(model: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, list, Path]:
    directory = tmp_path_factory.mktemp("tier")
    llm = LLM(model, kv_offloading_size=0.01, kv_offloading_dir=str(directory), **SMALL)
    return llm, _run(llm), directory


def test_snapshots_and_blocks_come_back_with_the_cold_run_tokens(
    cold: list, tiered: tuple[LLM, list, Path]
) -> None:
    llm, outs, _ = tiered
    assert outs == cold
    engine = llm.llm_engine
    bm = engine.block_manager
    assert bm.state_pool.num_blocks == 4
    states = bm.state_pool.tier
    # Every returning turn hit its whole 6-block prefix, which a hybrid can only do with the
    # snapshot after block 6: one snapshot was still in its slot, the other came from disk.
    stats = engine.get_stats()
    assert stats.prefix_cache_hits == (6 + 6) * BS
    assert stats.prefix_cache_tier_hits == (3 + 6) * BS
    assert states.num_saved >= 2 and states.num_loaded == 1
    assert engine.kv_tier.store.stats.corrupt == 0
    assert_pool_clean(engine)


def test_a_corrupt_snapshot_file_is_a_miss(
    cold: list, model: str, tiered: tuple[LLM, list, Path], tmp_path: Path
) -> None:
    """Only the snapshot files are damaged: B's attention blocks load, but without a state
    to resume from the hybrid cannot use them, and recomputes (the cold run's tokens). (B's
    snapshot is the one on disk: D's evicted it, the least recently used, before B returned.)"""
    llm, _, directory = tiered
    state_group = llm.llm_engine.block_manager.state_pool.tier
    suffix = (b"\x00group" + str(_state_group_id(llm)).encode()).hex() + ".kv"
    damaged = tmp_path / "damaged"
    shutil.copytree(directory, damaged)
    snapshots = [f for f in damaged.rglob("*.kv") if f.name.endswith(suffix)]
    assert snapshots and state_group is not None
    for f in snapshots:
        data = bytearray(f.read_bytes())
        data[-3] ^= 0xFF
        f.write_bytes(bytes(data))

    bad = LLM(model, kv_offloading_size=0.01, kv_offloading_dir=str(damaged), **SMALL)
    assert _run(bad, (1,)) == [cold[1]]
    engine = bad.llm_engine
    assert engine.kv_tier.num_loaded == 6  # the attention blocks were fine
    assert engine.kv_tier.store.stats.corrupt == 1
    assert engine.block_manager.state_pool.tier.num_loaded == 0
    assert engine.get_stats().prefix_cache_hits == 0
    assert_pool_clean(engine)


def _state_group_id(llm: LLM) -> int:
    managers = llm.llm_engine.block_manager.managers
    return next(m.group_id for m in managers if m.spec.kind == "recurrent")
