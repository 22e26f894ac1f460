"""The KV tier's stores on their own: exact round trips, damaged files are misses, the size cap
and LRU order hold, a killed writer leaves nothing bad to read, and bad settings are named;
and its connector on a bare block manager: a prefix found half in the pool, half in the tier.

No model here: payloads are made-up tensors, so every test runs in well under a second (the
kill test starts one small Python process).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tokenwise.config import CacheConfig
from tokenwise.engine.block_manager import BlockManager
from tokenwise.kv_cache.tier import CPUMemoryTier
from tokenwise.kv_cache.tier_blocks import KVTierConnector
from tokenwise.kv_cache.tier_disk import DiskTier, encode_header

PAYLOAD = 4096


def payload(i: int, size: int = PAYLOAD) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def file_size(k: bytes, size: int = PAYLOAD) -> int:
    return len(encode_header(k, memoryview(bytes(size)))) + size


def test_disk_round_trip_and_restart_adopts_files(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    for i in range(3):
        tier.put(key(i), payload(i))
    assert tier.flush(10)
    assert all(torch.equal(tier.get(key(i)), payload(i)) for i in range(3))
    assert tier.get(key(9)) is None
    tier.close()
    again = DiskTier(tmp_path, 1 << 20)  # a restarted engine
    assert all(torch.equal(again.get(key(i)), payload(i)) for i in range(3))
    assert again.stats.bytes_used == 3 * file_size(key(0))
    again.close()


def test_queued_payload_is_served_before_it_is_written(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    tier._queue.put(None)  # stop the writer: the next put stays queued
    tier._thread.join(5)
    tier.put(key(1), payload(1))
    assert tier.contains(key(1)) and not list(tmp_path.glob("*.kv"))
    assert torch.equal(tier.get(key(1)), payload(1))


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "other_key"])
def test_damaged_file_is_a_miss_and_is_removed(tmp_path: Path, damage: str) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    tier.put(key(1), payload(1))
    tier.put(key(2), payload(2))
    assert tier.flush(10)
    path = tier._path(key(1))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-100] ^= 0x01
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "empty":
        data = bytearray()
    else:  # a whole, valid file written for another key, under this key's name
        data = bytearray(tier._path(key(2)).read_bytes())
    path.write_bytes(bytes(data))
    assert tier.get(key(1)) is None
    assert tier.stats.corrupt == 1
    assert not path.exists() and not tier.contains(key(1))
    assert torch.equal(tier.get(key(2)), payload(2))  # the others still serve
    tier.close()


def test_disk_size_cap_evicts_least_recently_used(tmp_path: Path) -> None:
    one = file_size(key(0))
    tier = DiskTier(tmp_path, 3 * one)
    for i in range(3):
        tier.put(key(i), payload(i))
    assert tier.flush(10)
    assert tier.get(key(0)) is not None  # 0 is now the most recently used
    for i in (3, 4):
        tier.put(key(i), payload(i))
        assert tier.flush(10)
    assert tier.stats.bytes_used <= 3 * one
    assert sum(f.stat().st_size for f in tmp_path.glob("*.kv")) <= 3 * one
    assert [tier.contains(key(i)) for i in range(5)] == [True, False, False, True, True]
    assert tier.stats.evicted == 2
    tier.put(key(9), payload(9, 4 * one))  # larger than the whole tier: dropped
    assert tier.stats.dropped == 1 and not tier.contains(key(9))
    tier.close()
    smaller = DiskTier(tmp_path, one)  # a restart with a smaller cap trims at once
    assert smaller.stats.bytes_used <= one and len(list(tmp_path.glob("*.kv"))) == 1
    smaller.close()


def test_clear_drops_stored_and_queued_payloads(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    tier.put(key(1), payload(1))
    assert tier.flush(10)
    tier.put(key(2), payload(2))
    tier.clear()
    assert tier.flush(10)
    assert tier.get(key(1)) is None and tier.get(key(2)) is None
    assert not list(tmp_path.glob("*.kv"))
    tier.close()


_WRITER = textwrap.dedent(
    """
    import sys, torch
    from tokenwise.kv_cache.tier_disk import DiskTier
    tier = DiskTier(sys.argv[1], 1 << 34)
    for i in range(10**6):
        g = torch.Generator().manual_seed(i)
        tier.put(i.to_bytes(8, "little"), torch.randint(0, 256, (1 << 22,), dtype=torch.uint8, generator=g))
        tier.flush(60)
    """
)


def test_killed_writer_leaves_nothing_bad_to_read(tmp_path: Path) -> None:
    """SIGKILL a process writing 4 MiB blocks back to back: a restart deletes its half-written
    temporary file and every file it adopts serves exactly the bytes put under its key."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], env=env)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.kv"))) < 3:
            assert proc.poll() is None, "the writer process died"
            assert time.monotonic() < deadline, "the writer wrote nothing in 60 s"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    # Whether or not the kill caught a write, plant the half file such a kill leaves.
    (tmp_path / (b"\x07" * 8).hex()).with_suffix(".kv.123.1.tmp").write_bytes(b"half")
    tier = DiskTier(tmp_path, 1 << 34)
    assert not list(tmp_path.glob("*.tmp"))
    keys = list(tier._index)
    assert len(keys) >= 3
    for k in keys:
        i = int.from_bytes(k, "little")
        got = tier.get(k)
        assert got is not None and torch.equal(got, payload(i, 1 << 22))
    tier.close()


def test_cpu_memory_tier_cap_and_lru() -> None:
    tier = CPUMemoryTier(3 * PAYLOAD)
    for i in range(3):
        tier.put(key(i), payload(i))
    assert tier.get(key(0)) is not None
    tier.put(key(3), payload(3))
    assert [tier.contains(key(i)) for i in range(4)] == [True, False, True, True]
    assert tier.stats.bytes_used == 3 * PAYLOAD
    assert torch.equal(tier.get(key(3)), payload(3))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kv_offloading_size": 0}, "kv_offloading_size must be > 0 GiB"),
        ({"kv_offloading_size": -1.0}, "kv_offloading_size must be > 0 GiB"),
        ({"kv_offloading_backend": "lmcache"}, "LMCache is not built in"),
        ({"kv_offloading_backend": "ssd"}, "kv_offloading_backend must be one of"),
    ],
)
def test_bad_settings_are_named(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CacheConfig(**settings)


def test_unusable_directory_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="kv_offloading_dir .* is unusable"):
        DiskTier(blocker / "sub", 1 << 20)


def test_connector_pins_a_prefix_while_loading_its_tail() -> None:
    """A prefix whose head is still in the pool (and least recently used) and whose tail is in
    the tier: loading the tail must not evict the head. The hit covers all three blocks, each
    holding the bytes its block had, and every block is free again afterwards."""
    bs = 4
    bm = BlockManager(num_blocks=4, block_size=bs)
    cache = torch.zeros(4 + 1, bs, 2)  # block dimension 0, one trash row as the runner's
    connector = KVTierConnector(bm.pool, CPUMemoryTier(1 << 20), [(cache, 0)])
    bm.pool.tier = connector
    a, b = list(range(13)), list(range(100, 113))

    def fill(rid: str, tokens: list[int], n: int) -> list[int]:
        blocks = bm.allocate_slots(rid, tokens, 0, n)[0]
        for block in blocks:  # what a forward pass would write: the request's own values
            cache[block] = float(tokens[0] * 10 + blocks.index(block))
        return blocks

    fill("a", a, 12)
    bm.free("a")  # LRU order now: a's block 2, 1, 0
    fill("b", b, 12)  # the uncached block, then a's blocks 2 and 1 (into the tier)
    bm.free("b")  # LRU order: a's block 0, then b's
    assert connector.num_saved == 2
    hits, length = bm.get_computed_blocks("a2", a)
    assert length == 3 * bs
    assert [float(cache[block][0, 0]) for block in hits[0]] == [0.0, 1.0, 2.0]
    assert bm.prefix_cache_tier_hits == 2 * bs
    assert bm.allocate_slots("a2", a, 0, 1, hits) is not None
    bm.free("a2")
    bm.check_invariants()
    assert bm.get_num_free_blocks() == 4 and bm.pool.num_used == 0
