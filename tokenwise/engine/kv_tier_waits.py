"""The scheduler's side of overlapped KV-tier loads: requests waiting for their prefix's blocks.

Apart from `scheduler.py` (placement) and from `kv_cache/tier_loads.py` (the reads and the
blocks they fill) because this is only the request's part: when a request waits
(`RequestStatus.WAITING_FOR_REMOTE_KVS`, vLLM's name), when it may be placed again, and that
whatever it holds is let go when it leaves. Without a KV tier every hook is a no-op.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from tokenwise.engine.request import Request, RequestStatus


class KVTierWaits:
    """Mixed into the scheduler, which provides `block_manager`."""

    block_manager: Any

    def _tier_loads(self) -> Any:
        tier = self.block_manager.pool.tier
        return tier.loads if tier is not None else None

    def poll_tier_loads(self) -> None:
        """At the start of a pass: write in the loads that finished, give up the late ones."""
        loads = self._tier_loads()
        if loads is not None:
            loads.poll()

    def still_loading(self, request: Request) -> bool:
        """Whether a waiting request must keep waiting for its load; if not, it is placed as
        any waiting request (its prefix lookup comes next, and finds the loaded blocks)."""
        loads = self._tier_loads()
        if loads is None:
            return False
        loads.looking_up(request.request_id)
        if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return False
        if not loads.ready(request.request_id):
            return True
        request.status = RequestStatus.WAITING
        return False

    def start_tier_load(self, request: Request) -> bool:
        """Right after the request's prefix lookup: whether its hit needs blocks from the tier
        first (the reads start now, and the request waits)."""
        loads = self._tier_loads()
        if loads is None or not loads.begin(request.request_id):
            return False
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        return True

    def end_tier_wait(self, request: Request) -> None:
        """The request was placed (its table holds its blocks now) or left: drop its pins."""
        loads = self._tier_loads()
        if loads is not None:
            loads.drop(request.request_id)

    def release_tier_loads(self) -> bool:
        """The queue's head cannot be placed: free what waiting requests hold before anyone
        is aborted for want of blocks; whether to try again instead of aborting (something
        was freed, or a load is still in flight and will be, within its deadline)."""
        loads = self._tier_loads()
        return loads is not None and loads.release_loaded()

    @staticmethod
    def placeable_now(request: Request) -> bool:
        """Not waiting for something else first: a tier load, or its grammar's compile."""
        loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        return not loading and (request.grammar is None or request.grammar.ready)

    def tier_load_futures(self) -> list[Future]:
        loads = self._tier_loads()
        return loads.futures() if loads is not None else []


__all__ = ["KVTierWaits"]
