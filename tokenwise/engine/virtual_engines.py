"""Pipeline parallelism's virtual engines, seen by the engine loop as one scheduler and pool.

Under `pipeline_parallel_size=P` the engine keeps P batches in flight, one per virtual engine,
and virtual engine k owns what its batch needs to be scheduled while the others run: its own
`Scheduler` (running and waiting queues) over its own `BlockManager`, whose block ids index
`kv_cache[k]` of every attention layer. A request is placed on the least loaded virtual engine
when it arrives (the samples of an `n > 1` request together, so they share their prompt's
blocks) and stays there for its lifetime (`Request.virtual_engine`), so its steps never overlap
and its outputs come in order.

`VirtualEngineSchedulers` and `VirtualEngineBlockManagers` answer what the engine loop, its
statistics and its tests ask of one scheduler and one block manager, summed or routed to the
request's virtual engine; the pipeline loop (`pipeline_loop.py`) schedules each engine itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from tokenwise.engine.block_manager import BlockManager
from tokenwise.engine.request import Request, RequestStatus
from tokenwise.engine.scheduler import Scheduler
from tokenwise.engine.step_apply import OnToken
from tokenwise.engine.step_outputs import ModelRunnerOutput, SchedulerOutput


def check_kv_capacity(kind: Any, num_blocks: int, pp: int) -> None:
    """The model kind's check that `num_blocks` (per virtual engine) can hold a request,
    its error saying that the pool is split `pp` ways under pipeline parallelism."""
    try:
        kind.check_kv_capacity(num_blocks)
    except ValueError as exc:
        if pp == 1:
            raise
        raise ValueError(
            f"{exc}; that is per virtual engine: pipeline_parallel_size={pp} splits the "
            f"KV cache {pp} ways, so num_gpu_blocks must be {pp} times as large"
        ) from None


def make_schedulers(
    scheduler_cls: type[Scheduler], config: Any, managers: list[BlockManager]
) -> list[Scheduler]:
    """One `scheduler_cls` (the model kind's) per block manager, from the engine `config`."""
    max_loras = config.lora.max_loras if config.lora is not None else None
    return [
        scheduler_cls(config.scheduler, bm, config.model.max_model_len, max_loras)
        for bm in managers
    ]


class VirtualEngineSchedulers:
    def __init__(self, schedulers: list[Scheduler]) -> None:
        self.schedulers = schedulers
        self.config = schedulers[0].config
        self._last_group: tuple[str, int] | None = None

    def add_request(self, request: Request) -> None:
        """Place `request` on the virtual engine with the fewest requests (lowest on a tie);
        a sample of the group placed last goes where its siblings went."""
        if self._last_group is not None and self._last_group[0] == request.group_id:
            engine = self._last_group[1]
        else:
            loads = [len(s.running) + len(s.waiting) for s in self.schedulers]
            engine = loads.index(min(loads))
        self.schedulers[engine].add_request(request)
        request.virtual_engine = engine
        self._last_group = (request.group_id, engine)

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        on_token: OnToken | None = None,
    ) -> list[tuple[Request, int]]:
        if scheduler_output.is_empty:
            return []
        engine = scheduler_output.scheduled[0].request.virtual_engine
        return self.schedulers[engine].update_from_output(scheduler_output, runner_output, on_token)

    def finish_requests(
        self, requests: Iterable[Request], status: RequestStatus, discard_cached: bool = False
    ) -> None:
        by_engine: dict[int, list[Request]] = {}
        for req in requests:
            by_engine.setdefault(req.virtual_engine, []).append(req)
        for engine, reqs in by_engine.items():
            self.schedulers[engine].finish_requests(reqs, status, discard_cached)

    def waiting_grammars(self) -> list[Future]:
        return [f for s in self.schedulers for f in s.waiting_grammars()]

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.schedulers)

    @property
    def running(self) -> list[Request]:
        return [r for s in self.schedulers for r in s.running]

    @property
    def waiting(self) -> list[Request]:
        return [r for s in self.schedulers for r in s.waiting]

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.schedulers)


class _PoolsView:
    """The block pools' counts, summed (what step records and the KV grid read)."""

    def __init__(self, managers: list[BlockManager]) -> None:
        self._managers = managers

    def _sum(self, attr: str) -> int:
        return sum(getattr(m.pool, attr) for m in self._managers)

    @property
    def num_used(self) -> int:
        return self._sum("num_used")

    @property
    def num_free(self) -> int:
        return self._sum("num_free")

    @property
    def num_free_cached(self) -> int:
        return self._sum("num_free_cached")

    def block_states(self) -> bytes:
        """Every virtual engine's blocks, engine 0's first."""
        return b"".join(m.pool.block_states() for m in self._managers)


class VirtualEngineBlockManagers:
    """The virtual engines' block managers as one pool of `P * blocks_per_engine` blocks;
    global block id `k * blocks_per_engine + b` is block b of virtual engine k."""

    def __init__(self, managers: list[BlockManager]) -> None:
        self.managers = managers
        self.blocks_per_engine = managers[0].num_blocks
        self.block_size = managers[0].block_size
        self.pool = _PoolsView(managers)

    @property
    def num_blocks(self) -> int:
        return self.blocks_per_engine * len(self.managers)

    def get_num_free_blocks(self) -> int:
        return sum(m.get_num_free_blocks() for m in self.managers)

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.num_blocks if self.num_blocks else 0.0

    def get_ref_count(self, block_id: int) -> int:
        engine, block = divmod(block_id, self.blocks_per_engine)
        return self.managers[engine].get_ref_count(block)

    @property
    def prefix_cache_queries(self) -> int:
        return sum(m.prefix_cache_queries for m in self.managers)

    @property
    def prefix_cache_hits(self) -> int:
        return sum(m.prefix_cache_hits for m in self.managers)

    @property
    def prefix_cache_tier_hits(self) -> int:
        return sum(m.prefix_cache_tier_hits for m in self.managers)

    def reset_prefix_cache(self) -> bool:
        return all([m.reset_prefix_cache() for m in self.managers])

    def check_invariants(self) -> None:
        for manager in self.managers:
            manager.check_invariants()

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"{name!r}: under pipeline parallelism ask one virtual engine's block manager "
            "(`managers[k]`)"
        )
