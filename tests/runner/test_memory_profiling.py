"""KV-cache sizing on a GPU (vLLM's gpu_memory_utilization), with the arithmetic tested on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.engine._fixtures import checkpoint
from tokenwise import LLM
from tokenwise.runner.memory_profiling import kv_cache_budget_bytes, profile_run

GiB = 1 << 30


def test_budget_is_the_allowed_share_minus_what_the_profile_used() -> None:
    # 80 GiB GPU at 0.9: 72 GiB allowed; weights + activations peaked at 10 GiB, 1.5 GiB of
    # CUDA context and other processes: 60.5 GiB for the cache.
    budget = kv_cache_budget_bytes(80 * GiB, 0.9, 10 * GiB, 3 * GiB // 2)
    assert budget == int(80 * GiB * 0.9) - 10 * GiB - 3 * GiB // 2
    assert kv_cache_budget_bytes(100, 1.0, 30) == 70


def test_no_room_names_the_setting() -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.1 allows 8\.00 GiB"):
        kv_cache_budget_bytes(80 * GiB, 0.1, 8 * GiB, 0)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        kv_cache_budget_bytes(80 * GiB, 1.5, GiB)


def test_profile_run_never_touches_the_kv_cache() -> None:
    llm = LLM(
        checkpoint(),
        dtype="float32",
        num_gpu_blocks=8,
        max_model_len=128,
        max_num_batched_tokens=64,
    )
    runner = llm.llm_engine.runner
    for cache in runner.kv_caches.values():
        cache.fill_(3.0)
    profile_run(runner.model, runner.config, runner.device)
    assert all(torch.all(cache == 3.0) for cache in runner.kv_caches.values())
