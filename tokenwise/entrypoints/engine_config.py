"""Engine arguments -> `EngineConfig`: what `LLM(...)` and `tokenwise serve` build an engine from.

Every keyword a user passes (vLLM's names) is checked here, once, with errors naming the
parameter, and resolved against the model (its kind, its quantization, its architecture) and
the device, before any engine part is built.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tokenwise.config import (
    SPEC_MODEL_METHODS,
    CacheConfig,
    CompilationConfig,
    CUDAGraphMode,
    EngineConfig,
    LoRAConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenwise.engine.kinds.multimodal_settings import (
    check_multimodal_settings,
    parse_limit_mm_per_prompt,
)
from tokenwise.kv_cache.events_config import KVEventsConfig
from tokenwise.layers.fused_moe.experts import grouped_mm_available
from tokenwise.model_config import ModelConfig
from tokenwise.models.registry import (
    is_encoder_decoder_architecture,
    is_moe_architecture,
    is_multimodal_architecture,
)
from tokenwise.native import qgemv as cpu_qgemv
from tokenwise.pooling.task import check_embed_settings, resolve_pooler_config, resolve_task
from tokenwise.quantization_config import uses_cpu_kernels

logger = logging.getLogger("tokenwise")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_cudagraph_mode(
    cudagraph_mode: str | CUDAGraphMode | None,
    device: str,
    enforce_eager: bool,
    moe_needs_host: bool = False,
    cpu_graphs: bool = False,
) -> CUDAGraphMode:
    """The CUDA-graph mode: as asked (checked against device and eagerness), or the default.

    Default on CUDA: FULL_AND_PIECEWISE (whole decode steps and compiled pieces of mixed steps
    are replayed) when the attention backend's decode can be captured, else PIECEWISE; NONE
    with enforce_eager. MoE models whose expert op reads per-expert token counts on the host
    (`moe_needs_host`: no grouped matmul for the device and dtype) get PIECEWISE at most,
    since no captured graph can hold a host read; the graph is cut there like at attention.

    On CPU the graphs are recordings of the C kernels a decode step calls
    (`tokenwise.compilation.cpu_graph`): FULL_DECODE_ONLY by default (`cpu_graphs`: eagerness
    was not asked for and the model kind allows them), FULL_DECODE_ONLY or FULL when asked;
    sizes whose forward is not all C kernels run eagerly. Piecewise graphs need a GPU.
    """
    on_cuda = device.startswith("cuda")
    if cudagraph_mode is None:
        if not on_cuda:
            return CUDAGraphMode.FULL_DECODE_ONLY if cpu_graphs else CUDAGraphMode.NONE
        if enforce_eager:
            return CUDAGraphMode.NONE
        if moe_needs_host:
            return CUDAGraphMode.PIECEWISE
        from tokenwise.attention.backends.selector import BACKENDS, backend_name_for

        backend = BACKENDS[backend_name_for(device)]
        if getattr(backend, "supports_full_cudagraph", False):
            return CUDAGraphMode.FULL_AND_PIECEWISE
        return CUDAGraphMode.PIECEWISE
    mode = CUDAGraphMode.parse(cudagraph_mode)
    if mode == CUDAGraphMode.NONE:
        return mode
    if moe_needs_host and mode.has_full_cudagraphs():
        raise ValueError(
            f"cudagraph_mode={mode.name} captures whole forward passes, which this MoE model's "
            "expert layers cannot be part of (without a grouped matmul for this GPU and dtype, "
            "their token counts per expert are read on the host; bf16 on sm90+ has one); use "
            "cudagraph_mode=PIECEWISE"
        )
    if not on_cuda:
        if not cpu_graphs:
            raise ValueError(
                f"cudagraph_mode={mode.name} on CPU replays the C kernels of an eager forward: "
                "it cannot be combined with enforce_eager (True: no graphs; False: "
                "compilation), nor with this model kind or parallel layout; drop one of them"
            )
        if mode.requires_piecewise_compilation():
            raise ValueError(
                f"cudagraph_mode={mode.name} replays compiled pieces, which needs a CUDA device, "
                f"but device is {device!r}; on CPU use FULL_DECODE_ONLY (the default) or NONE"
            )
        return mode
    if enforce_eager:
        raise ValueError(
            f"cudagraph_mode={mode.name} cannot be combined with enforce_eager=True (eager "
            "means no compilation and no CUDA graphs); drop one of them"
        )
    return mode


def build_engine_config(
    model: str | None = None,
    dtype: str | torch.dtype = "auto",
    seed: int = 0,
    max_model_len: int | None = None,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 2048,
    block_size: int = 16,
    kv_cache_memory: int | None = None,
    kv_cache_dtype: str = "auto",
    num_gpu_blocks: int | None = None,
    load_format: str = "auto",
    enforce_eager: bool | None = None,
    skip_tokenizer_init: bool = False,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    gpu_memory_utilization: float = 0.9,
    tokenizer: str | None = None,
    device: str | None = None,
    cudagraph_mode: str | CUDAGraphMode | None = None,
    cudagraph_capture_sizes: list[int] | None = None,
    data_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    data_parallel_address: str | None = None,
    data_parallel_port: int | None = None,
    data_parallel_size_local: int | None = None,
    data_parallel_start_rank: int = 0,
    data_parallel_rpc_port: int = 29550,
    enable_expert_parallel: bool = False,
    enable_microbatching: bool = False,
    microbatching_token_threshold: int | None = None,
    enable_dbo: bool = False,
    dbo_decode_token_threshold: int | None = None,
    dbo_prefill_token_threshold: int | None = None,
    enable_lora: bool = False,
    max_loras: int = 1,
    max_lora_rank: int = 16,
    max_cpu_loras: int | None = None,
    task: str = "generate",
    override_pooler_config: PoolerConfig | None = None,
    disable_log_requests: bool = True,
    speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
    quantization: str | None = None,
    scheduling_policy: str = "fcfs",
    limit_mm_per_prompt: dict[str, int] | None = None,
    max_num_encoder_input_tokens: int | None = None,
    kv_events_config: str | dict[str, Any] | KVEventsConfig | None = None,
) -> EngineConfig:
    """One place that turns user-facing arguments (LLM, CLI, server) into an EngineConfig."""
    from tokenwise.default_model import resolve_model_path

    device = device or default_device()
    # CPU graphs (recorded C kernels) unless eagerness is asked for or a model kind rules it.
    cpu_graphs = enforce_eager is None
    if enforce_eager is None:
        # On CPU compiling costs 15+ s and gained only 3-16% in decode (PERF_NOTES), so eager
        # is the default there; on GPU compilation is what makes the small kernels cheap.
        enforce_eager = not device.startswith("cuda")
    model_config = ModelConfig.from_pretrained(
        resolve_model_path(model),
        dtype=dtype,
        max_model_len=max_model_len,
        device=device,
        seed=seed,
        load_format=load_format,
        tokenizer=tokenizer,
        skip_tokenizer_init=skip_tokenizer_init,
        quantization=quantization,
    )
    if uses_cpu_kernels(model_config.quantization, device):
        if not enforce_eager:
            raise ValueError(
                f"quantization={model_config.quantization!r} runs its CPU kernels eagerly "
                "(torch.compile does not trace them): leave enforce_eager at its default or True"
            )
        cpu_qgemv.activation_bits()  # a bad TOKENWISE_CPU_QUANT_ACTIVATIONS fails here
    num_labels = int(getattr(model_config.hf_config, "num_labels", 2))
    model_config.task = resolve_task(task, model_config.architectures, num_labels)
    check_kv_cache_dtype(kv_cache_dtype, model_config)
    if model_config.is_pooling:
        if model_config.task != "embed" and override_pooler_config is not None:
            raise ValueError(
                "override_pooler_config applies to task='embed' models only: a classifier "
                "pools as it was trained (its head reads [CLS], or the last token)"
            )
        model_config.pooler_config = resolve_pooler_config(
            model_config.model, model_config.architectures, override_pooler_config
        )
        check_embed_settings(data_parallel_size, tensor_parallel_size, cudagraph_mode)
        # See tokenwise.engine.kinds.pooling_runner.
        enforce_eager, cudagraph_mode, cpu_graphs = True, None, False
    elif override_pooler_config is not None:
        raise ValueError("override_pooler_config applies to task='embed' models only")
    if is_encoder_decoder_architecture(model_config.architectures):
        check_encoder_decoder_settings(data_parallel_size, tensor_parallel_size)
        if cudagraph_mode is None or CUDAGraphMode.parse(cudagraph_mode) == CUDAGraphMode.NONE:
            # Compiled and graphed only when a graph mode is asked for: that path is tested on
            # CPU with capture faked, not yet on a GPU (tokenwise.engine.kinds.encoder_decoder_runner).
            enforce_eager, cpu_graphs = True, False
    if is_multimodal_architecture(model_config.architectures):
        check_multimodal_settings(
            model_config, limit_mm_per_prompt, data_parallel_size, tensor_parallel_size
        )
        # See engine/kinds/multimodal_runner.py.
        enforce_eager, cudagraph_mode, cpu_graphs = True, None, False
    else:  # a text-only model refuses every image, whatever the limit says
        model_config.limit_mm_per_prompt = parse_limit_mm_per_prompt(limit_mm_per_prompt)
    speculative = None
    if speculative_config is not None:
        speculative = SpeculativeConfig.from_dict(speculative_config)
        archs = model_config.architectures
        if (
            model_config.is_pooling
            or is_encoder_decoder_architecture(archs)
            or is_multimodal_architecture(archs)
        ):
            raise ValueError(
                "speculative_config applies to text-only decoder generation models, not to "
                f"{', '.join(model_config.architectures)}"
            )
        if speculative.method in ("eagle", "eagle3", "mtp"):
            cpu_graphs = False  # the head reads the target's hidden states eagerly
        if speculative.method in SPEC_MODEL_METHODS and tensor_parallel_size > 1:
            # The draft (or EAGLE / MTP head) runs on the driver alone, unsharded; its layers
            # would read the TP rank.
            raise ValueError(
                f"speculative_config.method {speculative.method!r}: its draft model does not run "
                f"under tensor_parallel_size={tensor_parallel_size} yet (use data parallelism, "
                "where each rank runs its own draft, or method 'ngram')"
            )
    is_moe = is_moe_architecture(model_config.architectures)
    collectives = (data_parallel_size > 1 and is_moe) or tensor_parallel_size > 1
    collectives = collectives or pipeline_parallel_size > 1
    if collectives:
        cpu_graphs = False  # CPU graphs record kernels, not collectives
    if collectives and not enforce_eager:
        # Layers that talk to other ranks run eagerly for now: captured collectives are
        # not verified yet (no GPU was at hand when this was built).
        logger.info("tensor or pipeline parallelism, or DP with MoE, runs eagerly (no graphs)")
        enforce_eager, cudagraph_mode, cpu_graphs = True, None, False
    hf = model_config.hf_config
    moe_needs_host = False
    if is_moe:
        moe_size = getattr(hf, "moe_intermediate_size", 0) or hf.intermediate_size
        moe_needs_host = not grouped_mm_available(
            device, model_config.dtype, (hf.hidden_size, moe_size)
        )
    mode = resolve_cudagraph_mode(
        cudagraph_mode, device, enforce_eager, moe_needs_host, cpu_graphs and not is_moe
    )
    parallel = ParallelConfig(
        data_parallel_size=data_parallel_size,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        is_moe_model=is_moe,
        enable_expert_parallel=enable_expert_parallel,
        # vLLM's name for the same switch (dual-batch overlap).
        enable_microbatching=enable_microbatching or enable_dbo,
        data_parallel_master_ip=data_parallel_address or "127.0.0.1",
        data_parallel_master_port=data_parallel_port,
        data_parallel_size_local=data_parallel_size_local,
        data_parallel_start_rank=data_parallel_start_rank,
        data_parallel_rpc_port=data_parallel_rpc_port,
    )
    if microbatching_token_threshold is not None:
        parallel.microbatching_decode_token_threshold = microbatching_token_threshold
        parallel.microbatching_prefill_token_threshold = microbatching_token_threshold
    for name, value in (
        ("dbo_decode_token_threshold", dbo_decode_token_threshold),
        ("dbo_prefill_token_threshold", dbo_prefill_token_threshold),
    ):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if dbo_decode_token_threshold is not None:
        parallel.microbatching_decode_token_threshold = dbo_decode_token_threshold
    if dbo_prefill_token_threshold is not None:
        parallel.microbatching_prefill_token_threshold = dbo_prefill_token_threshold
    return EngineConfig(
        model=model_config,
        cache=CacheConfig(
            block_size=block_size,
            kv_cache_memory=kv_cache_memory,
            cache_dtype=kv_cache_dtype,
            num_gpu_blocks=num_gpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
            gpu_memory_utilization=gpu_memory_utilization,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            policy=scheduling_policy,
            max_num_encoder_input_tokens=max_num_encoder_input_tokens,
        ),
        compilation=CompilationConfig(
            use_compile=not enforce_eager,
            cudagraph_mode=mode,
            cudagraph_capture_sizes=cudagraph_capture_sizes,
        ),
        parallel=parallel,
        device=device,
        lora=LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None,
        log_requests=not disable_log_requests,
        speculative=speculative,
        kv_events_config=_kv_events_config(kv_events_config, enable_prefix_caching),
    )


def _kv_events_config(
    value: str | dict[str, Any] | KVEventsConfig | None, enable_prefix_caching: bool
) -> KVEventsConfig | None:
    """`kv_events_config`, refused without the prefix cache whose changes the events are."""
    config = KVEventsConfig.from_cli(value) if value is not None else None
    if config is not None and config.active and not enable_prefix_caching:
        raise ValueError(
            "kv_events_config enables KV-cache events, which report the prefix cache's "
            "contents, but prefix caching is off (--no-enable-prefix-caching): enable one "
            "without disabling the other"
        )
    return config


def check_kv_cache_dtype(kv_cache_dtype: str, model_config: ModelConfig) -> None:
    """Refuse an fp8 KV cache, by name, for the model kinds whose caches have no fp8 path
    yet: embedding (pooling) models and encoder-decoder models (the cross cache). DeepSeek's
    MLA latent cache is refused when the runner allocates it (`runner/kv_cache_sizing.py`)."""
    if not str(kv_cache_dtype).startswith("fp8"):
        return
    archs = model_config.architectures
    kind = None
    if model_config.is_pooling:
        kind = f"task={model_config.task!r} (pooling) models"
    elif is_encoder_decoder_architecture(archs):
        kind = "encoder-decoder models"
    if kind is not None:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported for {kind}; use 'auto'"
        )


def check_encoder_decoder_settings(data_parallel_size: int, tensor_parallel_size: int) -> None:
    """Encoder-decoder models run on one rank for now: refuse what would not apply."""
    if data_parallel_size != 1 or tensor_parallel_size != 1:
        raise ValueError(
            "encoder-decoder models (BART, Whisper) run on one rank: data_parallel_size and "
            f"tensor_parallel_size must be 1, got {data_parallel_size} and {tensor_parallel_size}"
        )
