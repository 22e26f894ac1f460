"""How big the KV cache pool is, and how each layer's cache is allocated and bound.

A part the runner holds (`runner.kv_sizer`), built from what sizing reads (the config, the
layers, their layout, the device, the TP channel, the graph runner), because sizing is a concept
of its own: every attention layer answers the shape of its
own cache (K/V per KV head, an MLA latent, cross K/V; encoder-only layers keep none), the pool
gets as many blocks as the memory budget allows for all of them together, and the start-up log
says what one token costs per layer kind.

Layers are grouped by their KV-cache specs (`tokenwise.kv_cache.layout`, made once by
`make_kv_cache_layout` at start-up): a block id costs one page of every tensor of the layout, and a
tensor may serve one layer of each of several groups (sliding-window and full-attention layers
of the same shape share tensors, so blocks a window frees serve the full layers).

The cache's dtype is `kv_cache_dtype` (`CacheConfig.cache_dtype`): the model's by default, or
an fp8 format with one byte per element, so the same budget holds twice the blocks of a bf16
cache (4x of fp32). Only K/V caches have an fp8 path; an MLA latent cache refuses it by name.

Under pipeline parallelism each cache tensor is allocated once per virtual engine
(`copies`): `layer.kv_cache[k]` is virtual engine k's (docs/forward-context.md).
"""

from __future__ import annotations

import gc
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenwise.attention.backends.kv_quant import is_fp8, kv_cache_torch_dtype
from tokenwise.attention.layer import AttentionLayerBase
from tokenwise.kv_cache.layout import KVCacheLayout, make_layout
from tokenwise.runner.graph_runner import CUDAGraphRunner
from tokenwise.runner.memory_profiling import cuda_kv_cache_budget

logger = logging.getLogger("tokenwise.runner.model_runner")

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # 1 GiB when nothing else is said


def cache_layers(attn_layers: dict[str, AttentionLayerBase]) -> dict[str, AttentionLayerBase]:
    """The attention layers that keep a KV cache (encoder-only attention keeps none)."""
    return {name: layer for name, layer in attn_layers.items() if layer.needs_kv_cache}


def resolved_kv_cache_dtype(config: Any) -> torch.dtype:
    """The dtype the cache tensors are allocated in (`kv_cache_dtype`, resolved)."""
    return kv_cache_torch_dtype(config.cache.cache_dtype, config.model.dtype)


def make_kv_cache_layout(config: Any, attn_layers: dict[str, AttentionLayerBase]) -> KVCacheLayout:
    """The layers with a cache grouped by their KV-cache specs (made once, at start-up)."""
    block_size, dtype = config.cache.block_size, resolved_kv_cache_dtype(config)
    specs = {
        name: layer.kv_cache_spec(block_size, dtype)
        for name, layer in cache_layers(attn_layers).items()
    }
    # Pipeline stages each hold some layers: sliding windows keep every block there, so
    # that every stage's groups are the driver's (see `make_layout`).
    return make_layout(specs, hybrid=config.parallel.pipeline_parallel_size == 1)


@dataclass
class KVCacheSizer:
    """Sizes the pool for one runner and allocates its cache tensors (`copies` per tensor:
    one per pipeline virtual engine)."""

    config: Any
    attn_layers: dict[str, AttentionLayerBase]
    kv_cache_layout: KVCacheLayout
    device: torch.device
    model: Any
    tp: Any
    graph_runner: CUDAGraphRunner | None
    needs_kv_cache: bool
    copies: int = 1
    num_state_slots: int = 0
    # A second KV group outside this runner's layers, addressed by the same block ids (a draft
    # model's): its bytes beside each block, and its bytes outside the pool (scratch blocks).
    extra_bytes_per_block: int = 0
    reserved_bytes: int = 0
    # Layer name -> the cache tensor of virtual engine 0 (filled by `bind`).
    kv_caches: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def block_size(self) -> int:
        return int(self.config.cache.block_size)

    @property
    def model_config(self) -> Any:
        return self.config.model

    def cache_layers(self) -> dict[str, AttentionLayerBase]:
        return cache_layers(self.attn_layers)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return resolved_kv_cache_dtype(self.config)

    def _check_kv_cache_dtype(self) -> None:
        """An fp8 cache for K/V caches only: the MLA latent (and cross K/V) have no fp8 path."""
        if not is_fp8(self.kv_cache_dtype):
            return
        for name, layer in self.cache_layers().items():
            if layer.kv_cache_kind != "K/V":
                raise ValueError(
                    f"kv_cache_dtype={self.config.cache.cache_dtype!r} is not supported for "
                    f"the {layer.kv_cache_kind} cache of layer {name}; use 'auto'"
                )

    def _cache_elements_per_block(self, layer: AttentionLayerBase) -> int:
        """One block's elements in `layer`'s cache (each layer knows its own cache shape)."""
        one, two = (math.prod(layer.kv_cache_shape(n, self.block_size)) for n in (1, 2))
        return two - one

    def add_group(self, bytes_per_block: int, reserved_bytes: int) -> None:
        """Count another runner's KV group (a draft model's) in this pool's budget."""
        self.extra_bytes_per_block += bytes_per_block
        self.reserved_bytes += reserved_bytes

    def kv_cache_bytes_per_block(self) -> int:
        """What one block id of the pool costs: a page of every cache tensor (and of a draft
        model's, when one shares the block ids)."""
        return self.kv_cache_layout.bytes_per_block + self.extra_bytes_per_block

    def report(self) -> str:
        """Per kind of cache: elements and bytes per token per layer, e.g. "MLA latent: 40
        elements (160 bytes) per token per layer x 3 layers"."""
        elem = self.kv_cache_dtype.itemsize
        kinds: dict[tuple[str, int], int] = {}
        for layer in self.cache_layers().values():
            key = (layer.kv_cache_kind, self._cache_elements_per_block(layer) // self.block_size)
            kinds[key] = kinds.get(key, 0) + 1
        return (
            "; ".join(
                f"{kind}: {n} elements ({n * elem} bytes) per token per layer x {count} layers"
                for (kind, n), count in kinds.items()
            )
            + f"; dtype {str(self.kv_cache_dtype).removeprefix('torch.')}; "
            + self.kv_cache_layout.describe()
            + (
                f"; a draft model's KV group: {self.extra_bytes_per_block} bytes per block "
                f"(+ {self.reserved_bytes} bytes of scratch blocks)"
                if self.extra_bytes_per_block
                else ""
            )
        )

    def determine_num_blocks(self) -> int:
        """KV blocks for the pool (the same on every TP rank); also sets `num_state_slots`,
        the recurrent-state slots, whose memory comes out of the same budget first."""
        if not self.needs_kv_cache:
            self.num_state_slots = 0
            return 0  # encoder-only attention keeps nothing between steps
        self._check_kv_cache_dtype()
        cache = self.config.cache
        self.num_state_slots = self._wanted_state_slots()
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks  # the same on every TP rank
        budget = cache.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                budget = cuda_kv_cache_budget(self.model, self.config, self.device)
                budget -= self._measure_graph_memory()
            else:
                # Never below one full sequence: the default must not fail the start-up check.
                one_seq = self._bytes_for_seqs(1)
                full = self._bytes_for_seqs(self.config.scheduler.max_num_seqs)
                budget = max(one_seq, min(DEFAULT_CPU_KV_CACHE_MEMORY, full))
                budget += self.reserved_bytes  # a draft's scratch blocks on top
        budget -= self._state_memory(budget) + self.reserved_bytes
        num_blocks = self.tp.agree_on_min(int(budget // self.kv_cache_bytes_per_block()))
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={budget} bytes is less than one KV block "
                f"({self.kv_cache_bytes_per_block()} bytes); raise it"
            )
        return int(num_blocks)

    def _wanted_state_slots(self) -> int:
        """A live slot per request the scheduler may run, and as many again for prefix-cache
        snapshots when prefix caching is on (0 without recurrent layers)."""
        if not self.kv_cache_layout.bytes_per_state_slot:
            return 0
        seqs = self.config.scheduler.max_num_seqs
        return 2 * seqs if self.config.cache.enable_prefix_caching else seqs

    def _state_memory(self, budget: int) -> int:
        """Bytes the recurrent states take out of `budget`: every wanted slot while they fit
        in half of it, else as many as do (at least one request's)."""
        # One copy of every state tensor per pipeline virtual engine.
        per_slot = self.kv_cache_layout.bytes_per_state_slot * self.copies
        if not per_slot:
            return 0
        if budget < per_slot + self.kv_cache_bytes_per_block():
            raise ValueError(
                f"kv_cache_memory={budget} bytes cannot hold one request's recurrent state "
                f"({per_slot} bytes over {len(self._state_layer_names())} layers) and one KV "
                f"block ({self.kv_cache_bytes_per_block()} bytes); raise it"
            )
        self.num_state_slots = max(1, min(self.num_state_slots, budget // 2 // per_slot))
        return self.num_state_slots * per_slot

    def _state_layer_names(self) -> list[str]:
        return [
            name
            for group in self.kv_cache_layout.groups
            if group.spec.pool == "state"
            for name in group.layer_names
        ]

    def _bytes_for_seqs(self, num_seqs: int) -> int:
        """Blocks for `num_seqs` sequences at max_model_len (max_num_seqs of them is the most
        a step can ever use), over every KV-cache group."""
        blocks_per_seq = self.kv_cache_layout.blocks_per_request(
            self.model_config.max_model_len, self.config.scheduler.max_num_batched_tokens
        )
        per_seq = blocks_per_seq * self.kv_cache_bytes_per_block()
        return num_seqs * (per_seq + 2 * self.kv_cache_layout.bytes_per_state_slot)

    def _measure_graph_memory(self) -> int:
        """Device bytes the CUDA graphs take, measured by capturing them on a one-block cache.

        Measured on an H100 (Qwen3-0.6B shape, FULL_AND_PIECEWISE): capture added 0.72 GiB and
        the kernels it loaded 0.11 GiB, which a KV cache sized from the profile alone pushed
        past `gpu_memory_utilization`. The runner's one graph runner does the measuring
        (`CUDAGraphRunner.measure`, which drops what must be captured again on the real cache);
        the placeholder cache is released here before the real one is allocated.
        """
        if self.graph_runner is None:
            return 0
        self.bind(1)
        graphs = self.graph_runner.measure()
        self.kv_caches.clear()
        for layer in self.attn_layers.values():
            layer.kv_cache = []
        gc.collect()
        logger.info("memory of CUDA graphs (measured by capturing them): %.2f GiB", graphs / 2**30)
        return graphs

    def allocate(self, num_blocks: int) -> None:
        """The pool's cache tensors, bound to their layers (none for a model that keeps
        none), and a log line of what they cost."""
        for layer in self.attn_layers.values():
            if not layer.needs_kv_cache:  # its empty placeholder, read by every virtual engine
                layer.kv_cache = [layer.kv_cache[0]] * self.copies
        if not self.needs_kv_cache:
            if num_blocks:
                raise ValueError(f"this model keeps no KV cache, got {num_blocks} blocks")
            logger.info("no KV cache: the model's attention keeps nothing between steps")
            return
        self.bind(num_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB); %s",
            num_blocks,
            self.block_size,
            num_blocks * self.kv_cache_bytes_per_block() * self.copies / 2**20,
            self.report(),
        )

    def bind(self, num_blocks: int) -> None:
        """Allocate the layout's cache tensors (`copies` of each) and bind each to its layers
        by name: `layer.kv_cache[k]` is copy k."""
        layers = self.cache_layers()
        for tensor in self.kv_cache_layout.tensors:
            rows = num_blocks if tensor.pool == "kv" else self.num_state_slots
            shape = layers[tensor.shared_by[0]].kv_cache_shape(rows, self.block_size)
            caches = [
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
                for _ in range(self.copies)
            ]
            for name in tensor.shared_by:
                self.kv_caches[name] = caches[0]
                layers[name].kv_cache = caches
