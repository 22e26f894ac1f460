"""The disk tier: one checksummed file per block payload in a local directory, LRU under a cap.

Why files, on a CPU engine: its KV cache already lives in host memory, so a host-memory tier
would compete with the cache it extends; local disk (and the page cache in front of it) is the
cheaper, larger level.

What keeps a bad block from being served:

- every file starts with a header: a magic, the key it was written for, the payload's length
  and its CRC-32; `get` checks all four against the key asked for and the bytes read, so a
  truncated, corrupt or misnamed file is a miss (and is deleted), never a payload;
- a payload is written to a temporary file in the same directory, then renamed into place
  (atomic on POSIX): a reader sees a whole file or none, and an engine killed mid-write leaves
  only a `.tmp` file, which the next start deletes. No fsync: a killed process loses nothing
  the page cache holds; what a power loss garbles, the checksum refuses.

Writes run on one background thread behind a bounded queue: `put` copies nothing and never
waits; a full queue drops the payload (counted in `stats.dropped`). A payload still queued is
served from memory, so a block evicted and wanted back at once is a hit. `clear` bumps a
generation so that a write already queued (or in flight) for the old weights never lands.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import torch

from tokenwise.kv_cache.tier import KVTierStore

logger = logging.getLogger("tokenwise.kv_cache")

MAGIC = b"TWKVBLK1"
_HEADER = struct.Struct("<8sHQI")  # magic, key length, payload length, CRC-32 of the payload
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
#: Payloads waiting for the writer at most; beyond it `put` drops (the step never waits).
QUEUE_DEPTH = 256


def encode_header(key: bytes, payload: memoryview) -> bytes:
    return _HEADER.pack(MAGIC, len(key), len(payload), zlib.crc32(payload)) + key


def read_payload(path: Path, key: bytes) -> torch.Tensor | None:
    """The payload of the file at `path` if it is whole, uncorrupted and written for `key`."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
            if len(head) != _HEADER.size:
                return None
            magic, key_len, length, crc = _HEADER.unpack(head)
            if magic != MAGIC or key_len != len(key) or f.read(key_len) != key:
                return None
            buf = bytearray(length)
            if f.readinto(buf) != length or f.read(1):  # truncated, or trailing bytes
                return None
    except OSError:
        return None
    if zlib.crc32(buf) != crc:
        return None
    return torch.frombuffer(buf, dtype=torch.uint8) if length else torch.empty(0, dtype=torch.uint8)


class DiskTier(KVTierStore):
    """Block payloads as files under `directory`, at most `capacity_bytes` of them in all."""

    name = "disk"

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"kv_offloading_dir {str(directory)!r} is unusable: {exc}") from exc
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, LRU first
        self._pending: dict[bytes, torch.Tensor] = {}
        self._generation = 0
        self._closed = False
        self._tmp_count = 0
        self._scan()
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_DEPTH)
        self._thread = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._thread.start()

    def _path(self, key: bytes) -> Path:
        return self.directory / (key.hex() + SUFFIX)

    def _scan(self) -> None:
        """Adopt the files a previous run left (oldest first), delete its half-written ones,
        and trim to the cap (a smaller cap than last time)."""
        found = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(TMP_SUFFIX):
                Path(entry.path).unlink(missing_ok=True)
            elif entry.name.endswith(SUFFIX):
                try:
                    key = bytes.fromhex(entry.name[: -len(SUFFIX)])
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.stats.bytes_used += size
        self._trim(0)

    def _trim(self, incoming: int) -> None:
        """Evict least recently used files until `incoming` more bytes fit (lock held)."""
        while self._index and self.stats.bytes_used + incoming > self.capacity_bytes:
            key = next(iter(self._index))
            size = self._index.pop(key)
            self.stats.bytes_used -= size
            self.stats.evicted += 1
            self._path(key).unlink(missing_ok=True)

    # ---- the interface ----------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return key in self._index or key in self._pending

    def put(self, key: bytes, payload: torch.Tensor) -> None:
        size = _HEADER.size + len(key) + payload.numel()
        with self._lock:
            if key in self._index or key in self._pending:
                return
            if size > self.capacity_bytes or self._closed:
                self.stats.dropped += 1
                return
            try:
                self._queue.put_nowait((self._generation, key, payload))
            except queue.Full:
                self.stats.dropped += 1
                return
            self._pending[key] = payload

    def get(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            payload = self._pending.get(key)
            known = key in self._index
        if payload is None and known:
            payload = read_payload(self._path(key), key)
            with self._lock:
                size = self._index.pop(key, None) if payload is None else None
                if size is not None:  # (None: the writer evicted it while we read)
                    self.stats.corrupt += 1
                    logger.warning("KV tier: %s failed its check; treated as a miss", key.hex())
                    self.stats.bytes_used -= size
                    self._path(key).unlink(missing_ok=True)
                elif payload is not None and key in self._index:
                    self._index.move_to_end(key)
        with self._lock:
            if payload is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
        if payload is not None and known:
            try:  # so that a restart's scan sees the recency
                os.utime(self._path(key))
            except OSError:
                pass
        return payload

    def clear(self) -> None:
        with self._lock:
            self._generation += 1
            self._pending.clear()
            for key in self._index:
                self._path(key).unlink(missing_ok=True)
            self._index.clear()
            self.stats.bytes_used = 0

    def flush(self, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.002)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._closed = True
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            logger.warning("KV tier: the writer did not drain in %.0f s; leaving it", timeout_s)
            return
        self._thread.join(timeout_s)

    # ---- the writer thread ------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # a full disk, a removed directory: drop, keep serving
                logger.exception("KV tier: writing a block failed; it is dropped")
                with self._lock:
                    self.stats.dropped += 1
                    self._pending.pop(item[1], None)
            finally:
                self._queue.task_done()

    def _write(self, generation: int, key: bytes, payload: torch.Tensor) -> None:
        data = memoryview(payload.numpy()).cast("B")
        header = encode_header(key, data)
        path = self._path(key)
        self._tmp_count += 1
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{self._tmp_count}{TMP_SUFFIX}")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(data)
        os.replace(tmp, path)
        size = len(header) + len(data)
        with self._lock:
            if generation != self._generation:  # cleared while queued: old weights' K/V
                path.unlink(missing_ok=True)
                return
            self._pending.pop(key, None)
            self._trim(size)
            self._index[key] = size
            self.stats.bytes_used += size
            self.stats.stored += 1


__all__ = ["MAGIC", "QUEUE_DEPTH", "DiskTier", "encode_header", "read_payload"]
