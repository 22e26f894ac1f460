"""Engine configuration: plain dataclasses that validate themselves.

`EngineConfig` is the one object the forward context receives. It groups the sub-configs that
per-step code reads (parallelism, compilation / CUDA graphs) plus the model, cache and scheduler
settings that the engine needs. `EngineConfig()` with no arguments is valid: the forward context
can be used (and tested) without any model.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Any

from tokenwise.kv_cache.events_config import KVEventsConfig


class CUDAGraphMode(enum.Enum):
    """How a forward pass is replayed from captured graphs.

    The two tuple modes name a (decode, mixed) pair: uniform-decode batches and mixed batches
    are dispatched through separate routines. Only the three plain modes are valid at run time.
    """

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def separate_routine(self) -> bool:
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        return mode in (self.decode_mode(), self.mixed_mode())

    def has_full_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.FULL)

    def requires_piecewise_compilation(self) -> bool:
        return self.has_mode(CUDAGraphMode.PIECEWISE)

    def valid_runtime_modes(self) -> bool:
        """True for the modes a single forward pass can run in (NONE, PIECEWISE, FULL)."""
        return self in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)

    @classmethod
    def parse(cls, value: str | int | CUDAGraphMode) -> CUDAGraphMode:
        """Accept an enum member, its name in any case (as typed on a command line) or an int."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().upper()
            if key in cls.__members__:
                return cls[key]
            raise ValueError(
                f"cudagraph_mode must be one of {', '.join(cls.__members__)} "
                f"(case-insensitive), got {value!r}"
            )
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(value)
        raise ValueError(f"cudagraph_mode must be a CUDAGraphMode or its name, got {value!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


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

    def __post_init__(self) -> None:
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(
                "distributed_executor_backend must be 'mp' or 'ray', got "
                f"{self.distributed_executor_backend!r}"
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
        if self.local_dp_size < 1 or end > self.data_parallel_size:
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
        `data_parallel_start_rank` on (all of them on a single host)."""
        if self.data_parallel_size_local is not None:
            return self.data_parallel_size_local
        return self.data_parallel_size - self.data_parallel_start_rank

    @property
    def spans_hosts(self) -> bool:
        """Whether some DP ranks run on other hosts (and connect to the front end over TCP)."""
        return self.local_dp_size != self.data_parallel_size


PIECE_BACKENDS = ("inductor", "eager")


@dataclass
class CompilationConfig:
    """torch.compile and CUDA-graph settings, plus the static registry of no-compile layers.

    `static_forward_context` maps a layer's module path to the layer itself. Attention layers
    fill it at construction; the forward context hands the *same dict* to the custom op, which
    is how an opaque op finds its layer (and KV cache) from a name.
    """

    static_forward_context: dict[str, Any] = field(default_factory=dict)
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE
    cudagraph_capture_sizes: list[int] | None = None
    use_compile: bool = False
    # Opaque ops the compiled graph is cut at (piecewise graphs never hold them): attention
    # (MLA's too), and the MoE experts, whose per-expert token counts are read on the host.
    splitting_ops: list[str] = field(
        default_factory=lambda: [
            "tokenwise::unified_attention",
            "tokenwise::mla_attention",
            "tokenwise::moe_experts",
        ]
    )
    # None: split the graph at `splitting_ops` exactly when the CUDA-graph mode has piecewise
    # graphs; True / False force piecewise / one full graph.
    piecewise_compile: bool | None = None
    # How the pieces between attention calls are compiled: "inductor", or "eager" (traced and
    # split but run as plain FX code: a debugging aid that isolates Inductor from the rest).
    piece_backend: str = "inductor"

    def __post_init__(self) -> None:
        self.cudagraph_mode = CUDAGraphMode.parse(self.cudagraph_mode)
        if self.piece_backend not in PIECE_BACKENDS:
            raise ValueError(
                f"piece_backend must be one of {', '.join(PIECE_BACKENDS)}, "
                f"got {self.piece_backend!r}"
            )
        if self.cudagraph_capture_sizes is not None:
            sizes = list(self.cudagraph_capture_sizes)
            for size in sizes:
                _check_int("cudagraph_capture_sizes entries", size, 1)
            self.cudagraph_capture_sizes = sorted(set(sizes))
        self._padded_size_table: list[int] | None = None
        self._padded_size_table_for: list[int] | None = None

    @property
    def use_piecewise_compile(self) -> bool:
        """Whether `torch.compile` splits the graph at the splitting ops."""
        if self.piecewise_compile is not None:
            return self.piecewise_compile
        return self.cudagraph_mode.requires_piecewise_compilation()

    @property
    def max_capture_size(self) -> int:
        return self.cudagraph_capture_sizes[-1] if self.cudagraph_capture_sizes else 0

    def pad_for_cudagraph(self, num_tokens: int) -> int | None:
        """Smallest capture size >= num_tokens, or None when the batch is too large for any graph.

        A lookup table makes this O(1) on the per-step path. It is rebuilt when the capture
        sizes were reassigned after construction (the engine may fill them in later), so a
        stale table never answers for a different list. Reassigned lists must stay ascending.
        """
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if num_tokens > self.max_capture_size:
            return None
        if (
            self._padded_size_table is None
            or self._padded_size_table_for != self.cudagraph_capture_sizes
        ):
            table = [0] * (self.max_capture_size + 1)
            sizes = self.cudagraph_capture_sizes or []
            idx = 0
            for b in range(1, self.max_capture_size + 1):
                while sizes[idx] < b:
                    idx += 1
                table[b] = sizes[idx]
            self._padded_size_table = table
            self._padded_size_table_for = list(sizes)
        return self._padded_size_table[num_tokens]


# vLLM's `kv_cache_dtype` values: "fp8" is "fp8_e4m3" (more precision, less range than e5m2).
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
# `kv_offloading_backend`: "native" is vLLM's (host memory; on a CPU engine, local disk).
KV_OFFLOADING_BACKENDS = ("native", "cpu", "disk")


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


SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
# Methods whose proposer is a model of its own (a checkpoint directory in `model`; for "mtp"
# the target's own checkpoint unless `model` names another).
SPEC_MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
# Where speculation stops paying on CPU (benchmarks/spec_decode.py, Llama ~100M shape, bf16,
# k=4): at 98% acceptance it still gave 1.84x at 32 streams, down from 2.9x at one; at a more
# usual ~50-60% acceptance that extrapolates to about break-even at 32 streams.
DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE = 32


@dataclass
class SpeculativeConfig:
    """Speculative decoding (`speculative_config`, vLLM's names and JSON form).

    `method` "ngram" proposes up to `num_speculative_tokens` drafts by prompt lookup: the
    tokens that followed the most recent earlier occurrence of the sequence's last
    `prompt_lookup_min`..`prompt_lookup_max` tokens. `model` (a checkpoint directory; method
    "draft_model", implied by `model`) has a smaller model with the target's vocabulary
    propose them greedily (`tokenwise.spec_decode.draft_model`). "eagle" and "eagle3" have an
    EAGLE head (`model`: its checkpoint directory, in the published layouts) propose them from
    the target's own hidden states (`tokenwise.spec_decode.eagle`). No proposal is made while
    `disable_by_batch_size` or more requests are running (verification then costs more than
    it saves). "mtp" runs DeepSeek-V3's multi-token-prediction module, kept in the target's
    checkpoint, the same way (`tokenwise.models.deepseek_mtp`).
    """

    num_speculative_tokens: int
    method: str | None = None
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        _check_int("speculative_config.num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "ngram"
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPEC_METHODS)}, "
                f"got {self.method!r}"
            )
        if self.method in SPEC_MODEL_METHODS:
            self._check_draft_model()
        elif self.model is not None:
            raise ValueError(
                "speculative_config.model applies to methods "
                f"{', '.join(SPEC_MODEL_METHODS)}, not {self.method!r}"
            )
        if self.method == "ngram":
            if self.prompt_lookup_min is None:
                self.prompt_lookup_min = 1
            if self.prompt_lookup_max is None:
                self.prompt_lookup_max = max(5, self.prompt_lookup_min)
            _check_int("speculative_config.prompt_lookup_min", self.prompt_lookup_min, 1)
            _check_int("speculative_config.prompt_lookup_max", self.prompt_lookup_max, 1)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(
                    "speculative_config.prompt_lookup_min must be <= prompt_lookup_max, got "
                    f"{self.prompt_lookup_min} > {self.prompt_lookup_max}"
                )
        if self.disable_by_batch_size is not None:
            _check_int("speculative_config.disable_by_batch_size", self.disable_by_batch_size, 1)

    def _check_draft_model(self) -> None:
        """A draft model or EAGLE head needs its checkpoint directory; prompt lookup settings
        are n-gram's.

        The draft's vocabulary (and an EAGLE head's hidden size) is checked against the
        target's when the engine loads it: only then are both configs read."""
        if self.model is None and self.method == "mtp":
            pass  # the MTP module is in the target's checkpoint
        elif self.model is None:
            what = "draft" if self.method == "draft_model" else "EAGLE head's"
            raise ValueError(
                f"speculative_config.model is required for method {self.method!r} (the {what} "
                "checkpoint directory)"
            )
        elif not isinstance(self.model, str) or not os.path.isdir(self.model):
            raise ValueError(
                f"speculative_config.model must be a checkpoint directory; {self.model!r} is not "
                "a directory"
            )
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"speculative_config.{name} applies to method 'ngram', not {self.method!r}"
                )

    @classmethod
    def from_dict(cls, fields: Any) -> SpeculativeConfig:
        """From the JSON object users write; unknown keys are errors naming them."""
        if isinstance(fields, SpeculativeConfig):
            return fields
        if not isinstance(fields, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {fields!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown field(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        if "num_speculative_tokens" not in fields:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        return cls(**fields)


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
