"""Engine configuration: plain dataclasses that validate themselves.

`EngineConfig` is the one object the forward context receives. It groups the sub-configs that
per-step code reads (parallelism, compilation / CUDA graphs) plus the model, cache and scheduler
settings that the engine needs. `EngineConfig()` with no arguments is valid: the forward context
can be used (and tested) without any model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenwise.compilation_config import (  # noqa: F401  (re-exported: their old home)
    PIECE_BACKENDS,
    CompilationConfig,
    CUDAGraphMode,
)
from tokenwise.config_checks import check_int as _check_int
from tokenwise.kv_cache.events_config import KVEventsConfig
from tokenwise.speculative_config import (  # noqa: F401  (re-exported: their old home)
    DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE,
    SPEC_METHODS,
    SPEC_MODEL_METHODS,
    SpeculativeConfig,
)


@dataclass
class ParallelConfig:
    """Data, tensor and pipeline parallelism. `is_moe_model=None` means unknown (treated like
    MoE). `pipeline_parallel_size` stages split the layers (`tokenwise.distributed.pp_state`)
    and as many virtual engines keep that many batches in flight."""

    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    is_moe_model: bool | None = None
    # MoE layers under DP > 1: True gives each rank whole experts (num_experts / dp_size of
    # them); False shards every expert's intermediate dimension over the DP ranks instead.
    enable_expert_parallel: bool = False
    # Where DP ranks rendezvous (torch.distributed TCP store); port None = a free one.
    data_parallel_master_ip: str = "127.0.0.1"
    data_parallel_master_port: int | None = None
    # DP across hosts (vLLM's names): this host runs ranks [start_rank, start_rank + size_local)
    # (size_local None = every rank from start_rank on); the ranks of other hosts connect to
    # the front end at data_parallel_master_ip:data_parallel_rpc_port (`engine/remote_ranks`).
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_rpc_port: int = 29550
    # Micro-batching ("dual batch overlap") thresholds: below these a batch is not split.
    enable_microbatching: bool = False
    microbatching_decode_token_threshold: int = 32
    microbatching_prefill_token_threshold: int = 512
    # How the other TP / PP ranks start (vLLM's name): "mp", spawned processes; "ray", Ray
    # actors (`tokenwise/executor/ray_workers.py`).
    distributed_executor_backend: str = "mp"
    # How the Ray backend's placement group spreads one bundle per TP/PP rank over the nodes:
    # one of Ray's strategies (`executor/ray_workers.py`; "PACK": as few nodes as have room).
    ray_placement_strategy: str = "PACK"
    # How the data-parallel ranks' engine cores start (vLLM's name): "mp", processes on this
    # host (and `--headless` hosts); "ray", every rank a Ray actor (`engine/ray_ranks.py`).
    data_parallel_backend: str = "mp"

    def __post_init__(self) -> None:
        for name in ("distributed_executor_backend", "data_parallel_backend"):
            if getattr(self, name) not in ("mp", "ray"):
                raise ValueError(f"{name} must be 'mp' or 'ray', got {getattr(self, name)!r}")
        if self.ray_placement_strategy not in RAY_PLACEMENT_STRATEGIES:
            raise ValueError(
                f"ray_placement_strategy must be one of {', '.join(RAY_PLACEMENT_STRATEGIES)}, "
                f"got {self.ray_placement_strategy!r}"
            )
        if self.ray_data_parallel and (
            self.data_parallel_size_local is not None or self.data_parallel_start_rank != 0
        ):
            raise ValueError(
                "data_parallel_size_local and data_parallel_start_rank do not apply with "
                "data_parallel_backend='ray' (Ray places every rank); leave them unset"
            )
        _check_int("data_parallel_size", self.data_parallel_size, 1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        _check_int("data_parallel_rank", self.data_parallel_rank, 0)
        if self.data_parallel_rank >= self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank must be in [0, data_parallel_size={self.data_parallel_size}),"
                f" got {self.data_parallel_rank}"
            )
        _check_int("data_parallel_start_rank", self.data_parallel_start_rank, 0)
        _check_int("data_parallel_rpc_port", self.data_parallel_rpc_port, 1)
        if self.data_parallel_rpc_port > 65535:
            raise ValueError(
                f"data_parallel_rpc_port must be in [1, 65535], got {self.data_parallel_rpc_port}"
            )
        if self.data_parallel_size_local is not None:
            _check_int("data_parallel_size_local", self.data_parallel_size_local, 1)
        end = self.data_parallel_start_rank + self.local_dp_size
        if not self.ray_data_parallel and (self.local_dp_size < 1 or end > self.data_parallel_size):
            raise ValueError(
                f"data_parallel_start_rank ({self.data_parallel_start_rank}) + "
                f"data_parallel_size_local ({self.local_dp_size}) must be <= "
                f"data_parallel_size ({self.data_parallel_size}), with at least one rank on "
                f"this host: its ranks are [start_rank, start_rank + size_local) of "
                f"[0, {self.data_parallel_size})"
            )

    @property
    def local_dp_size(self) -> int:
        """DP ranks on this host: `data_parallel_size_local`, by default every rank from
        `data_parallel_start_rank` on (all of them on a single host); none when Ray runs them
        all as actors (they connect like the ranks of other hosts)."""
        if self.ray_data_parallel:
            return 0
        if self.data_parallel_size_local is not None:
            return self.data_parallel_size_local
        return self.data_parallel_size - self.data_parallel_start_rank

    @property
    def ray_data_parallel(self) -> bool:
        """Whether the DP ranks are Ray actors (the Ray backend applies from two ranks on)."""
        return self.data_parallel_backend == "ray" and self.data_parallel_size > 1

    @property
    def spans_hosts(self) -> bool:
        """Whether some DP ranks run on other hosts (and connect to the front end over TCP)."""
        return self.local_dp_size != self.data_parallel_size


KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
# `kv_offloading_backend`: "native" is vLLM's (host memory; on a CPU engine, local disk).
KV_OFFLOADING_BACKENDS = ("native", "cpu", "disk")


#: Ray's placement-group strategies, for the Ray executor's ranks (`ray_placement_strategy`).
RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class CacheConfig:
    """Paged KV cache: block size, how much memory (or how many blocks) it gets, and the dtype
    its entries are stored in (`cache_dtype`, vLLM's name; `kv_cache_dtype` in `LLM(...)`):
    "auto" is the model's dtype; an fp8 format halves a bf16 cache's bytes per token, so the
    same memory holds twice the tokens (`attention/backends/kv_quant.py`)."""

    block_size: int = 16
    cache_dtype: str = "auto"
    kv_cache_memory: int | None = None  # bytes; None = engine default
    num_gpu_blocks: int | None = None  # explicit block count overrides the memory budget
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    # A second tier for prefix-cache blocks the pool evicts (`engine/kv_tier_setup.py`):
    # its size in GiB (None: off), its store, and the disk store's root directory.
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    kv_offloading_dir: str | None = None

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        if self.kv_offloading_size is not None and not self.kv_offloading_size > 0:
            raise ValueError(f"kv_offloading_size must be > 0 GiB, got {self.kv_offloading_size}")
        if self.kv_offloading_backend not in KV_OFFLOADING_BACKENDS:
            raise ValueError(
                f"kv_offloading_backend must be one of {', '.join(KV_OFFLOADING_BACKENDS)}, "
                f"got {self.kv_offloading_backend!r}"
                + (" (LMCache is not built in)" if self.kv_offloading_backend == "lmcache" else "")
            )
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.cache_dtype!r}"
            )
        if self.kv_cache_memory is not None:
            _check_int("kv_cache_memory", self.kv_cache_memory, 1)
        if self.num_gpu_blocks is not None:
            _check_int("num_gpu_blocks", self.num_gpu_blocks, 1)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    """Per-step limits of the continuous-batching scheduler, and its policy (vLLM's
    `scheduling_policy`): "fcfs" serves requests in arrival order; "priority" by each request's
    `priority` (lower first), then arrival (see `tokenwise.engine.request_queue`)."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    # A vision-language model's vision tower: image tokens it encodes per step at most (None:
    # `max_num_batched_tokens`, vLLM's default); see `engine/kinds/encoder_budget.py`.
    max_num_encoder_input_tokens: int | None = None
    # Schedule step N+1 while step N runs (`engine/async_step.py`), vLLM's `async_scheduling`.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_num_encoder_input_tokens is None:
            self.max_num_encoder_input_tokens = self.max_num_batched_tokens
        _check_int("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens, 1)
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.policy!r}"
            )


POOLING_TYPES = ("CLS", "MEAN", "LAST")


@dataclass
class PoolerConfig:
    """How an embedding model turns a sequence's hidden states into one vector (vLLM's names).

    `pooling_type`: "CLS" (the first token's state), "MEAN" (the average over the sequence's
    tokens) or "LAST" (the last token's); None = the checkpoint's choice. `normalize`: scale
    each embedding to unit L2 norm; None = the checkpoint's choice. Given to `LLM(...,
    override_pooler_config=...)`, a set field overrides what the checkpoint says.
    """

    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or (
                self.pooling_type.upper() not in POOLING_TYPES
            ):
                raise ValueError(
                    f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                    f"got {self.pooling_type!r}"
                )
            self.pooling_type = self.pooling_type.upper()
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be True, False or None, got {self.normalize!r}")


@dataclass
class LoRAConfig:
    """Adapter serving (`enable_lora`): how many adapters a step may mix, and how big they are.

    Slots for `max_loras` adapters of rank up to `max_lora_rank` are allocated at start-up in
    every targeted layer, so memory is fixed; adapters beyond `max_loras` wait in `max_cpu_loras`
    parsed copies on the host (least recently used ones are dropped first).
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None = max_loras

    def __post_init__(self) -> None:
        _check_int("max_loras", self.max_loras, 1)
        _check_int("max_lora_rank", self.max_lora_rank, 1)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _check_int("max_cpu_loras", self.max_cpu_loras, 1)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine instance is configured with.

    `model` holds the resolved model settings (a `tokenwise.model_config.ModelConfig`) once an
    engine is built; it is None when the forward context is used on its own.

    Frozen: which sub-configs an engine has is decided once, by
    `EngineArgs.create_engine_config`, and never swapped later. The sub-configs themselves stay
    mutable dataclasses, since the runner still fills in what only the loaded model tells
    (e.g. the CUDA-graph capture sizes).
    """

    model: Any | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    lora: LoRAConfig | None = None  # None: LoRA adapters are off
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # KV-cache events for cluster routers (`--kv-events-config`); None: off.
    kv_events_config: KVEventsConfig | None = None
    # One INFO line per finished request (`LLMEngine._forget`): on for the server, off for the
    # offline `LLM`, whose batch jobs would flood the log (`disable_log_requests`).
    log_requests: bool = False
    # `sleep` / `wake_up` allowed (`enable_sleep_mode`, `executor/sleep_mode.py`).
    enable_sleep_mode: bool = False
