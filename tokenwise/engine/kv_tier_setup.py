"""Turning `--kv-offloading-size` on: which store, where, and which engines are refused.

vLLM's spellings: `kv_offloading_size` (GiB the tier may hold) turns it on,
`kv_offloading_backend` picks the store: "native" is host memory on a CUDA engine (pinned) and
a directory of files on a CPU engine (whose host memory is already its KV cache); "cpu" and
"disk" name one of them outright. `kv_offloading_dir` (tokenwise's) is the disk tier's root;
each model (and KV layout, cache dtype, DP rank) gets a directory of its own under it, named by
a fingerprint, so that K/V written for one set of weights is never read for another one.

A model with recurrent-state layers gets a second connector on its state pool, over the same
store: its snapshots go out and come back under their chain hashes like attention blocks.
Loads run in the background (`kv_cache/tier_loads.py`) while the request waits.

Refused, with the reason: prefix caching off (the tier extends it), tensor or pipeline
parallelism (each rank holds a shard of each block; the connector copies the driver's only),
and speculative methods with a KV cache of their own (a draft model, EAGLE, MTP: their cache
would not follow a block loaded back).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from tokenwise import envs
from tokenwise.config import EngineConfig
from tokenwise.kv_cache.specs import CrossAttentionSpec
from tokenwise.kv_cache.tier import CPUMemoryTier, KVTierStore
from tokenwise.kv_cache.tier_blocks import KVTierConnector, block_dim
from tokenwise.kv_cache.tier_disk import DiskTier
from tokenwise.kv_cache.tier_loads import TierLoads

logger = logging.getLogger("tokenwise.engine")

_OWN_KV_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def check_kv_tier_supported(config: EngineConfig, runner: Any) -> None:
    """Raise ValueError naming the setting when this engine cannot use a KV tier."""
    p = config.parallel
    if not config.cache.enable_prefix_caching:
        raise ValueError(
            "kv_offloading_size extends the prefix cache, but prefix caching is off "
            "(--no-enable-prefix-caching): enable it, or drop kv_offloading_size"
        )
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(p, name) > 1:
            raise ValueError(f"kv_offloading_size is not supported with {name} > 1 yet")
    layout = runner.kv_cache_layout
    if not layout.groups:
        raise ValueError("kv_offloading_size: this model keeps no KV cache to offload")
    spec = config.speculative
    if spec is not None and spec.method in _OWN_KV_METHODS:
        raise ValueError(
            f"kv_offloading_size is not supported with speculative method {spec.method!r} "
            "(its own KV cache would not follow blocks loaded back from the tier)"
        )


def cache_tensors(runner: Any, pool: str = "kv") -> list[tuple[Any, int]]:
    """(tensor, block dimension) of every cache tensor a prefix-cached block lives in (`pool`
    "state": every recurrent-state tensor, indexed by the state pool's slots)."""
    layout = runner.kv_cache_layout
    cross = {
        n for g in layout.groups if isinstance(g.spec, CrossAttentionSpec) for n in g.layer_names
    }
    layers = runner.cache_layers()
    out = []
    for t in layout.tensors:
        if t.pool != pool or all(name in cross for name in t.shared_by):
            continue
        name = t.shared_by[0]
        out.append((runner.kv_caches[name], block_dim(layers[name], runner.block_size)))
    return out


def tier_fingerprint(config: EngineConfig, tensors: list[tuple[Any, int]]) -> str:
    """What the stored K/V depends on: the weights (path, files' sizes and times), dtypes,
    block size and the cache tensors' shapes. A different value: a different directory."""
    model = config.model
    path = Path(model.model)
    files: list[tuple[str, int, int]] = []
    candidates = sorted(path.iterdir()) if path.is_dir() else [path] if path.exists() else []
    for f in candidates:
        if f.suffix in _WEIGHT_SUFFIXES or f.name == "config.json":
            st = f.stat()
            files.append((f.name, st.st_size, st.st_mtime_ns))
    parts = (
        str(path.resolve()) if path.exists() else model.model,
        files,
        str(model.dtype),
        model.quantization,
        model.load_format,
        model.seed if model.load_format == "dummy" else 0,
        config.cache.cache_dtype,
        config.cache.block_size,
        [(tuple(t.shape), str(t.dtype), d) for t, d in tensors],
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def default_tier_root() -> Path:
    base = envs.external("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tokenwise" / "kv-tier"


def make_store(config: EngineConfig, tensors: list[tuple[Any, int]], device: str) -> KVTierStore:
    cache = config.cache
    assert cache.kv_offloading_size is not None
    capacity = int(cache.kv_offloading_size * 2**30)
    backend = cache.kv_offloading_backend
    if backend == "native":
        backend = "cpu" if device.startswith("cuda") else "disk"
    if backend == "cpu":
        return CPUMemoryTier(capacity, pin=device.startswith("cuda"))
    root = Path(cache.kv_offloading_dir) if cache.kv_offloading_dir else default_tier_root()
    rank = config.parallel.data_parallel_rank or 0
    return DiskTier(root / f"{tier_fingerprint(config, tensors)}-dp{rank}", capacity)


def attach_kv_tier(
    config: EngineConfig, managers: list[Any], runner: Any
) -> KVTierConnector | None:
    """The engine's KV tier, hooked into its block manager's pools (the KV pool, and the state
    pool of a recurrent model); None when `kv_offloading_size` is unset. Raises ValueError for
    an engine the tier does not support."""
    if config.cache.kv_offloading_size is None:
        return None
    check_kv_tier_supported(config, runner)
    tensors = cache_tensors(runner)
    states = cache_tensors(runner, "state")
    store = make_store(config, tensors + states, str(config.device))
    loads = TierLoads()
    manager = managers[0]
    connector = KVTierConnector(manager.pool, store, tensors)
    connector.loads = loads
    manager.pool.tier = connector
    if states:
        state_connector = KVTierConnector(manager.state_pool, store, states)
        state_connector.loads = loads
        manager.state_pool.tier = state_connector
    where = getattr(store, "directory", "host memory")
    logger.info(
        "KV tier: %s, %.2f GiB, %d KiB per block (%s)",
        store.name,
        store.capacity_bytes / 2**30,
        connector.block_bytes // 1024,
        where,
    )
    return connector


__all__ = ["attach_kv_tier", "cache_tensors", "check_kv_tier_supported", "tier_fingerprint"]
