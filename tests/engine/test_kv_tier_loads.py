"""Overlapped KV-tier loads: a request whose prefix is on disk waits while the blocks are read
in the background, and the running requests keep stepping meanwhile.

The store's reads are held at a gate the test opens, so "during the load" is a number of
engine steps, not a race with the clock. One tiny Llama engine (16-block pool) serves every
test: prompt A's blocks are pushed out to the disk tier by running the three other prompts.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.engine._fixtures import LLAMA, assert_pool_clean, checkpoint
from tests.engine._kv_tier_turns import PARAMS, SMALL
from tests.engine._kv_tier_turns import prompts as _prompts
from tokenwise import LLM, SamplingParams
from tokenwise.engine.request import RequestStatus

LONG = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
A = 0


SHORT = list(range(7, 27))  # the running request's prompt: shares no block with the others
BIG = [random.Random(1).randrange(5, 250) for _ in range(200)]  # 13 blocks with its answer


class Gate:
    """Holds the store's reads until `open` is set (bounded: a test never hangs on it)."""

    def __init__(self, store: Any, fail: bool = False) -> None:
        self.store, self.fail = store, fail
        self.opened = threading.Event()
        self._get = store.get
        store.get = self.get

    def get(self, key: bytes) -> Any:
        if self.fail:
            raise OSError("disk gone")
        if not self.opened.wait(30):
            raise TimeoutError("the test never opened the gate")
        return self._get(key)

    def remove(self) -> None:
        self.opened.set()
        self.store.get = self._get


def _generate(llm: LLM, prompt: list[int], params: SamplingParams = PARAMS) -> list[int]:
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def cold() -> dict[str, list[int]]:
    llm = LLM(checkpoint(LLAMA), enable_prefix_caching=False, **SMALL)
    return {
        "A": _generate(llm, _prompts()[A]),
        "short": _generate(llm, SHORT, LONG),
        "big": _generate(llm, BIG),
    }


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    directory: Path = tmp_path_factory.mktemp("tier")
    return LLM(
        checkpoint(LLAMA), kv_offloading_size=0.01, kv_offloading_dir=str(directory), **SMALL
    )


def _a_on_disk(llm: LLM) -> None:
    """Run A once (if it never ran), then the other prompts, until A's blocks are all out of
    the pool and in the store."""
    prompts, engine = _prompts(), llm.llm_engine
    for prompt in prompts:
        _generate(llm, prompt)
    assert engine.kv_tier.store.flush(30)
    tier_before = engine.get_stats().prefix_cache_tier_hits
    bm = engine.block_manager
    hashes = bm._block_hashes("probe", prompts[A], 6, None)
    bm.free("probe")
    assert all(bm.pool.lookup(h) is None for h in hashes)
    assert all(engine.kv_tier.store.contains(h) for h in hashes)
    assert engine.get_stats().prefix_cache_tier_hits == tier_before


def _request(engine: Any, rid: str) -> Any:
    return engine.groups[rid][0]


def test_running_requests_keep_stepping_while_a_load_is_held(llm: LLM, cold: dict) -> None:
    engine = llm.llm_engine
    _a_on_disk(llm)
    engine.add_request("short", {"prompt_token_ids": SHORT}, LONG)
    engine.step()
    short = _request(engine, "short")
    assert short.status == RequestStatus.RUNNING
    gate = Gate(engine.kv_tier.store)
    try:
        engine.add_request("a", {"prompt_token_ids": _prompts()[A]}, PARAMS)
        a = _request(engine, "a")
        for _ in range(6):
            before = len(short.output_token_ids)
            engine.step()
            assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            assert a.num_computed_tokens == 0 and not a.output_token_ids
            assert len(short.output_token_ids) == before + 1  # one token every step
    finally:
        gate.remove()
    tier_before = engine.get_stats().prefix_cache_tier_hits
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert list(a.output_token_ids) == cold["A"]
    assert list(short.output_token_ids) == cold["short"]
    assert a.num_cached_tokens == 6 * 16
    assert engine.get_stats().prefix_cache_tier_hits - tier_before == 6 * 16
    assert_pool_clean(engine)


def test_abort_mid_load_frees_every_block(llm: LLM, cold: dict) -> None:
    engine = llm.llm_engine
    _a_on_disk(llm)
    gate = Gate(engine.kv_tier.store)
    try:
        engine.add_request("a", {"prompt_token_ids": _prompts()[A]}, PARAMS)
        engine.step()
        assert _request(engine, "a").status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert engine.block_manager.get_num_free_blocks() < 16  # blocks reserved for the load
        engine.abort_request("a")
        engine.step()
        assert_pool_clean(engine)
    finally:
        gate.remove()
    assert engine.kv_tier.store.flush(30)
    assert _generate(llm, _prompts()[A]) == cold["A"]  # the cancelled read wrote nothing
    assert_pool_clean(engine)


@pytest.mark.parametrize("failure", ["timeout", "error"])
def test_a_late_or_failed_load_is_recomputed(llm: LLM, cold: dict, failure: str) -> None:
    engine = llm.llm_engine
    _a_on_disk(llm)
    loads = engine.kv_tier.loads
    timeouts, failed = loads.num_timeouts, loads.num_failed
    gate = Gate(engine.kv_tier.store, fail=failure == "error")
    loads.timeout_s = 0.2
    try:
        tier_before = engine.get_stats().prefix_cache_tier_hits
        assert _generate(llm, _prompts()[A]) == cold["A"]
        assert engine.get_stats().prefix_cache_tier_hits == tier_before  # nothing served
        assert loads.num_timeouts - timeouts == (failure == "timeout")
        assert loads.num_failed - failed == 6
    finally:
        loads.timeout_s = 30.0
        gate.remove()
    assert_pool_clean(engine)


def test_a_load_holding_blocks_delays_the_head_instead_of_aborting_it(llm: LLM, cold: dict) -> None:
    """A's load reserves 6 of the 16 blocks; BIG, queued behind it, needs 13 and nothing runs.
    That is no reason to abort BIG: the load ends, A runs, then BIG does."""
    engine = llm.llm_engine
    _a_on_disk(llm)
    gate = Gate(engine.kv_tier.store)
    try:
        engine.add_request("a", {"prompt_token_ids": _prompts()[A]}, PARAMS)
        engine.add_request("big", {"prompt_token_ids": BIG}, PARAMS)
        a, big = _request(engine, "a"), _request(engine, "big")
        for _ in range(4):
            engine.step()
            assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            assert big.status == RequestStatus.WAITING  # neither placed nor aborted
    finally:
        gate.remove()
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert list(a.output_token_ids) == cold["A"] and a.num_cached_tokens == 6 * 16
    assert list(big.output_token_ids) == cold["big"]
    assert_pool_clean(engine)
