"""The one start-up sequence every rank of an engine runs, in one place.

The driver's worker (built by the engine's executor), each spawned tensor-parallel worker and
each pipeline stage (`executor/worker_main.py`) make the same start-up collectives in the same
order only if they run the same code, so every `Worker.start` runs `start_runner`:

1. build the runner: its worker has joined the groups already (on the driver, the executor
   spawned the other ranks and met them at the rendezvous); it builds this rank's model shard;
2. agree on the KV block count (`determine_num_blocks`: a MIN over the ranks, which the driver
   waits for while checking its workers);
3. check the count (driver only; no collective), then allocate the cache (local).

A failure after the runner exists shuts it down; the executor then stops the other ranks and
leaves the groups, so a failed start-up leaves nothing behind for the next engine of this
process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar


class StartableRunner(Protocol):
    def determine_num_blocks(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def shutdown(self) -> None: ...


R = TypeVar("R", bound=StartableRunner)


def start_runner(
    make_runner: Callable[[], R], check_num_blocks: Callable[[int], None] | None = None
) -> tuple[R, int]:
    """Build the runner, agree on its block count, check it, allocate the cache; return both."""
    runner = make_runner()
    try:
        num_blocks = runner.determine_num_blocks()
        if check_num_blocks is not None:
            check_num_blocks(num_blocks)
        runner.initialize_kv_cache(num_blocks)
    except BaseException:
        runner.shutdown()
        raise
    return runner, num_blocks
