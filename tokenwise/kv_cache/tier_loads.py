"""Overlapped tier loads: a prefix hit in the KV tier is read on a background thread while the
request waits (vLLM's `WAITING_FOR_REMOTE_KVS`) and the other requests keep stepping.

Why: reading a block back (a file, its checksum) takes far longer than a step's bookkeeping;
done inside the prefix lookup it stalls every running request for as long as the read lasts.

How the pieces share the work, all of the pool's side in the engine's thread:

- during a lookup, a key that misses the pool but is in the store is *deferred*
  (`KVTierConnector.hit` -> `defer`): a free block (or state slot) is reserved for it,
  unregistered, so no other lookup can hit its not-yet-written contents, and the lookup
  carries on as if it hit. A key another request is already loading is not loaded twice: the
  lookup waits for that load instead;
- `begin` hands the lookup's reads to the loader thread (only `KVTierStore.get`, which is
  thread-safe: the thread never touches a pool or a cache tensor) and the request waits;
- `poll`, at the start of each scheduling pass, writes every finished read into its block and
  registers it (`KVTierConnector.finish_load`); the block stays pinned by the request that
  asked for it until it is admitted (`admitted`) or leaves (`drop`), so the request's second
  lookup, which now hits the pool, finds it;
- a read that fails, or that is not back within `timeout_s`, is a miss: its block is released
  uncached, and the request's next lookup defers nothing (`_no_defer`): it recomputes from
  the first block it lacks rather than try the same slow or broken reads again. Nothing waits
  unbounded.

Blocks are written between forward passes, into blocks no request's table holds, so no
forward pass can read a half-written block.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger("tokenwise.kv_cache")

#: Seconds a tier load may take before it is given up (the request then recomputes).
LOAD_TIMEOUT_S = 30.0


@dataclass
class _Load:
    """One background read: the blocks reserved for it, by key, and when it is given up."""

    items: list[tuple[Any, int, bytes]]  # (connector, block id, key)
    future: Future
    deadline: float
    cancelled: threading.Event = field(default_factory=threading.Event)


class TierLoads:
    """The engine's background tier reads, and which waiting request holds which block."""

    def __init__(self, timeout_s: float = LOAD_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"a tier load timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-loader")
        self._lookup: dict[bytes, tuple[Any, int]] = {}  # this lookup's reads: key -> (conn, block)
        self._lookup_waits: set[bytes] = set()  # keys this lookup found already loading
        self._in_flight: dict[bytes, tuple[Any, int, _Load]] = {}  # key -> (conn, block, load)
        self._loads: dict[str, _Load] = {}  # request id -> its read (until finished)
        self._waits: dict[str, set[bytes]] = {}  # request id -> keys it waits for
        self._pins: dict[str, list[tuple[Any, int]]] = {}  # request id -> (pool, block) held
        self._no_defer: set[str] = set()  # requests whose last load failed: they recompute
        self._current: str | None = None  # the request whose lookup comes next
        self.num_failed = 0  # blocks a read could not serve (missing, corrupt, late)
        self.num_timeouts = 0  # loads given up at their deadline
        self.read_seconds = 0.0  # the loader thread's time in finished reads (benchmarks)

    # ---- during a lookup ----------------------------------------------------------------------

    def looking_up(self, request_id: str) -> None:
        """The next lookup is `request_id`'s (so that one whose load failed defers nothing)."""
        self._current = request_id

    def defer(self, connector: Any, key: bytes) -> int | None:
        """The block `key` will be loaded into (a hit for the lookup), or None: a miss."""
        if self._current in self._no_defer:
            return None
        loading = self._in_flight.get(key)
        if loading is not None:
            self._lookup_waits.add(key)
            return loading[1]
        if key in self._lookup:
            return self._lookup[key][1]
        pool = connector.pool
        if pool.num_free == 0 or not connector.store.contains(key):
            return None
        block_id = pool.allocate()  # the reservation; may evict (and save) another block
        self._lookup[key] = (connector, block_id)
        return block_id

    @property
    def lookup_deferred(self) -> bool:
        """Whether the lookup now ending needs a load (its hit is not usable yet)."""
        return bool(self._lookup or self._lookup_waits)

    # ---- the scheduler's side ---------------------------------------------------------------

    def begin(self, request_id: str) -> bool:
        """End the request's lookup: start its reads; whether the request must wait."""
        items = [(conn, block_id, key) for key, (conn, block_id) in self._lookup.items()]
        waits = self._lookup_waits
        self._lookup, self._lookup_waits = {}, set()
        if not items and not waits:
            return False
        if items:
            cancelled = threading.Event()
            future = self._executor.submit(_read, [(c.store, k) for c, _, k in items], cancelled)
            load = _Load(items, future, time.monotonic() + self.timeout_s, cancelled)
            self._loads[request_id] = load
            for conn, block_id, key in items:
                self._in_flight[key] = (conn, block_id, load)
            self._pins.setdefault(request_id, []).extend((c.pool, b) for c, b, _ in items)
        self._waits[request_id] = waits | {k for _, _, k in items}
        return True

    def poll(self) -> None:
        """Write in every finished read; give up the late ones (engine thread, each pass)."""
        now = time.monotonic()
        for request_id, load in list(self._loads.items()):
            if load.future.done():
                payloads, seconds = load.future.result()
                self.read_seconds += seconds
            elif now >= load.deadline:
                load.cancelled.set()
                self.num_timeouts += 1
                logger.warning(
                    "KV tier: a load of %d blocks for request %s took over %.1f s; recomputing",
                    len(load.items),
                    request_id,
                    self.timeout_s,
                )
                payloads = [None] * len(load.items)
            else:
                continue
            del self._loads[request_id]
            self._finish(request_id, load, payloads)

    def _finish(self, request_id: str, load: _Load, payloads: list) -> None:
        pins = self._pins.get(request_id, [])
        for (conn, block_id, key), payload in zip(load.items, payloads, strict=True):
            self._in_flight.pop(key, None)
            if conn.finish_load(block_id, key, payload):
                continue
            pins.remove((conn.pool, block_id))
            conn.pool.release(block_id)  # unregistered: back to the free list
            if conn.pool.lookup(key) is None:  # (else cached meanwhile, another way)
                self.num_failed += 1
                self._no_defer.add(request_id)

    def ready(self, request_id: str) -> bool:
        """Whether every key the request waits for is loaded (or given up)."""
        waits = self._waits.get(request_id)
        if waits and any(k in self._in_flight for k in waits):
            return False
        self._waits.pop(request_id, None)
        return True

    def admitted(self, request_id: str) -> None:
        """The request holds its blocks in its own table now: drop the load's pins."""
        for pool, block_id in reversed(self._pins.pop(request_id, [])):
            pool.release(block_id)

    def drop(self, request_id: str) -> None:
        """The request left (aborted, finished): stop its read, release whatever it held."""
        load = self._loads.pop(request_id, None)
        if load is not None:
            load.cancelled.set()
            for _, _, key in load.items:
                self._in_flight.pop(key, None)
        self._waits.pop(request_id, None)
        self._no_defer.discard(request_id)
        self.admitted(request_id)

    def release_loaded(self) -> bool:
        """Unpin every finished load's blocks (they stay cached, so their requests still find
        them unless evicted): the pool is stuck without them, as the queue's head cannot be
        placed. Whether anything was released, or a load is still in flight (it ends within
        its deadline; then try again)."""
        done = [r for r in self._pins if r not in self._loads]
        for request_id in done:
            self.admitted(request_id)
        return bool(done or self._loads)

    def futures(self) -> list[Future]:
        """The reads in flight (an idle engine sleeps on them, briefly)."""
        return [load.future for load in self._loads.values()]

    def close(self) -> None:
        for load in self._loads.values():
            load.cancelled.set()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _read(items: list[tuple[Any, bytes]], cancelled: threading.Event) -> tuple[list, float]:
    """The loader thread: each key's payload from its store (None: a miss, or given up), and
    the seconds it took."""
    start = time.perf_counter()
    out: list[torch.Tensor | None] = []
    for store, key in items:
        if cancelled.is_set():
            out.append(None)
            continue
        try:
            out.append(store.get(key))
        except Exception:  # an unreadable store is a miss, never a failed step
            logger.exception("KV tier: reading a block failed; it is recomputed")
            out.append(None)
    return out, time.perf_counter() - start


__all__ = ["LOAD_TIMEOUT_S", "TierLoads"]
