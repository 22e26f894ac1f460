"""What an engine may leave behind in the test process: child processes and parallel state.

psutil is no dependency: children come from `/proc/<pid>/task/*/children` (every thread's
children, which is every child) plus `multiprocessing.active_children()`; multiprocessing's
resource tracker is long-lived by design and not an engine's.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import torch.distributed as dist

from tokenwise.distributed.pp_state import get_pp_size, is_pp_initialized
from tokenwise.distributed.tp_state import get_tp_size, is_tp_initialized


def child_processes() -> set[str]:
    """`pid (state) command` of every child of this process (zombies too: not joined)."""
    me = os.getpid()
    pids: set[int] = {p.pid for p in mp.active_children() if p.pid is not None}
    for task in os.listdir(f"/proc/{me}/task"):
        try:
            with open(f"/proc/{me}/task/{task}/children") as f:
                pids.update(int(p) for p in f.read().split())
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:  # gone between the listing and the read
            continue
        if "resource_tracker" not in cmd:
            found.add(f"{pid} ({state}) {cmd[:120]}")
    return found


def assert_nothing_left(before: set[str], what: str) -> None:
    """No new child process, no TP / PP group, no default process group."""
    left = child_processes() - before
    assert not left, f"{what} left processes behind: {sorted(left)}"
    assert not is_tp_initialized() and get_tp_size() == 1, f"{what} left the TP group"
    assert not is_pp_initialized() and get_pp_size() == 1, f"{what} left the PP group"
    assert not dist.is_initialized(), f"{what} left torch.distributed's default group"
