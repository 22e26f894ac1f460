"""Where a tensor-parallel worker starts: one entry point, taken before any engine is built.

Under torchrun every rank runs the caller's command. A rank other than 0 must hand over to
`run_tp_worker` from the engine constructors (`create_engine`, `LLMEngine(...)`) without
building an engine, and end its process with status 0 once the driver is done; rank 0, and
any process outside torchrun, must not be touched. The worker itself is replaced by a recorder
here (the real one is run by tests/engine/test_tensor_parallel.py's torchrun launch).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine._fixtures import checkpoint
from tokenwise.engine import client
from tokenwise.engine.llm_engine import LLMEngine
from tokenwise.entrypoints.llm import build_engine_config
from tokenwise.executor import worker_main as tp_worker


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, Any]]:
    calls: list[tuple[int, Any]] = []
    monkeypatch.setattr(
        tp_worker, "run_tp_worker", lambda config, rank, init: calls.append((rank, init))
    )
    for name in ("MASTER_ADDR", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    return calls


def torchrun_env(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")


def tp_config(tp: int = 2, dp: int = 1) -> Any:
    config = build_engine_config(checkpoint("Qwen3ForCausalLM"), dtype="float32")
    config.parallel.tensor_parallel_size = tp
    config.parallel.data_parallel_size = dp
    return config


@pytest.mark.parametrize("construct", ["create_engine", "LLMEngine"])
def test_a_torchrun_worker_rank_serves_and_exits_before_any_engine_exists(
    construct: str, recorded: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    torchrun_env(monkeypatch, rank=1)
    built: list[Any] = []
    monkeypatch.setattr(LLMEngine, "__init__", lambda self, *a, **k: built.append(self))
    config = tp_config()
    with pytest.raises(SystemExit) as exited:
        if construct == "create_engine":
            client.create_engine(config)
        else:
            LLMEngine(config, "cpu")
    assert exited.value.code == 0
    assert recorded == [(1, None)]  # torchrun's environment is the rendezvous
    assert built == []  # no engine (and so no model, no runner) on a worker rank


def test_rank_0_and_plain_processes_build_the_engine(
    recorded: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    torchrun_env(monkeypatch, rank=0)
    tp_worker.maybe_serve_torchrun_worker(tp_config())
    monkeypatch.setenv("RANK", "1")
    tp_worker.maybe_serve_torchrun_worker(tp_config(tp=1))  # no TP: nothing to serve
    monkeypatch.delenv("MASTER_ADDR")
    tp_worker.maybe_serve_torchrun_worker(tp_config())  # not launched by torchrun
    assert recorded == []


def test_data_parallel_under_torchrun_is_refused_on_every_rank(
    recorded: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    torchrun_env(monkeypatch, rank=1)
    with pytest.raises(ValueError, match="data_parallel_size > 1 under torchrun"):
        tp_worker.maybe_serve_torchrun_worker(tp_config(dp=2))
    assert recorded == []


def test_spawning_workers_needs_the_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenwise.distributed.tp_launch import start_tensor_parallel

    for name in ("RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    # Keeps start_tensor_parallel from sharing this process's cores out among "ranks".
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    with pytest.raises(ValueError, match="needs the TP worker entry point"):
        start_tensor_parallel(tp_config(), None)
