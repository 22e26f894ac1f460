"""Worker entry points that fail at start-up in chosen ways (spawned by the engine in
`test_startup_bounds.py` in place of `run_tp_worker`; module-level so spawn can find them)."""

from __future__ import annotations

import os
import time
from typing import Any

EXIT_AT_ONCE_CODE = 3
EXIT_AFTER_JOINING_CODE = 5


def exit_at_once(config: Any, rank: int, init_method: str | None) -> None:
    """As a worker whose spawn failed (a script without a `__main__` guard): gone at once."""
    os._exit(EXIT_AT_ONCE_CODE)


def never_arrive(config: Any, rank: int, init_method: str | None) -> None:
    """Alive, but never reaches the rendezvous (stuck importing, say)."""
    time.sleep(600)


def exit_after_joining(config: Any, rank: int, init_method: str | None) -> None:
    """Joins the groups, then dies while the driver builds its shard and waits to agree."""
    from tokenwise.distributed.tp_launch import join_parallel_groups

    join_parallel_groups(config, rank, init_method)
    os._exit(EXIT_AFTER_JOINING_CODE)
