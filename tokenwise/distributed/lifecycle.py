"""What an engine leaves behind in its process: nothing, checked before the next one starts.

Tensor and pipeline parallelism keep process-wide state (`tp_state`, `pp_state`: the groups,
this process's rank and size, which every parallel layer reads at construction) and worker
processes. A runner releases them when it shuts down, or when it is garbage-collected (a
`weakref.finalize`). But an engine sits in reference cycles (its model kind points back at it),
so `del engine` frees it only at the next cyclic collection: until then its workers wait for
steps and its group stays joined, and a second engine built meanwhile would read TP size 2
from the stale state and join the dead engine's collectives, waiting forever.
`ensure_clean_parallel_state` runs first in every engine's start-up: it collects dropped
engines (their finalizers stop their workers and leave their groups), and refuses to start
beside an engine still in use, naming it, rather than corrupting both.

`watch_parent` is the workers' side: a worker whose driver died without stopping it (killed,
out of memory) exits at once instead of waiting on a group nobody will use again.
"""

from __future__ import annotations

import gc
import os
import threading
import time

from tokenwise.distributed.pp_state import get_pp_size, is_pp_initialized
from tokenwise.distributed.tp_state import get_tp_size, is_tp_initialized

PARENT_POLL_S = 0.5


def held_parallel_state() -> str | None:
    """A phrase naming the process-wide parallel state some engine holds, if any does."""
    held = []
    if is_tp_initialized():
        held.append(f"a tensor-parallel group (tensor_parallel_size={get_tp_size()})")
    if is_pp_initialized():
        held.append(f"a pipeline-parallel group (pipeline_parallel_size={get_pp_size()})")
    return " and ".join(held) or None


def ensure_clean_parallel_state() -> None:
    """Before an engine builds its runner: no other engine's groups or workers in this process.

    Dropped engines are collected first (their finalizers stop their workers and reset the
    state); an engine still referenced somewhere is the caller's to shut down, so this raises
    naming what it holds. (A spawned worker or a DP engine core joins its groups before its
    runner is built and does not come through here.)
    """
    if held_parallel_state() is None:
        return
    gc.collect()
    held = held_parallel_state()
    if held is not None:
        raise RuntimeError(
            f"another engine in this process still holds {held}: shut it down first "
            "(LLM.shutdown() or LLMEngine.shutdown()), or drop every reference to it; one "
            "process serves one tensor- or pipeline-parallel engine at a time"
        )


def watch_parent() -> None:
    """End this (worker) process when the process that spawned it is gone (its parent id
    changes when it is re-parented). A daemon thread; the check is a cheap system call."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="tokenwise-parent-watch", daemon=True).start()
