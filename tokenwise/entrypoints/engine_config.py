"""`EngineArgs` -> `EngineConfig`: what `LLM(...)` and `tokenwise serve` build an engine from.

The settings (declared in `engine_args.py`) are resolved here, once, against the model (its
kind, its quantization, its architecture) and the device, before any engine part is built:
the feature table (`feature_rules.py`) refuses what does not combine, and every derived field
(task, pooler, MoE, CUDA-graph mode) is filled in, so no later code patches the config.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tokenwise.config import (
    CacheConfig,
    CompilationConfig,
    CUDAGraphMode,
    EngineConfig,
    LoRAConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenwise.engine.kinds.multimodal_settings import parse_limit_mm_per_prompt
from tokenwise.entrypoints.feature_rules import Features, check_features
from tokenwise.envs import warn_undeclared
from tokenwise.kv_cache.events_config import KVEventsConfig
from tokenwise.layers.fused_moe.experts import grouped_mm_available
from tokenwise.model_config import ModelConfig
from tokenwise.models.registry import (
    is_encoder_decoder_architecture,
    is_moe_architecture,
    is_multimodal_architecture,
)
from tokenwise.native import qgemv as cpu_qgemv
from tokenwise.pooling.task import resolve_pooler_config, resolve_task
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


def _eager_kinds(features: Features, cudagraph_mode: Any) -> tuple[bool, Any, bool] | None:
    """(enforce_eager, cudagraph_mode, cpu_graphs) for the model kinds that run eagerly, or
    None for a kind the graph settings apply to.

    Pooling models (`engine/kinds/pooling_runner.py`), vision-language models
    (`engine/kinds/multimodal_runner.py`) and MXFP4 checkpoints always run eagerly; encoder-decoder models are
    compiled and graphed only when a graph mode is asked for: that path is tested on CPU with
    capture faked, not yet on a GPU (`engine/kinds/encoder_decoder_runner.py`).
    """
    if features.pooling or features.multimodal:
        return True, None, False
    if features.model.quantization == "mxfp4":
        # Its experts dequantize per call, one expert at a time (a host read): no graphs yet.
        logger.info("MXFP4 experts run eagerly (no torch.compile or graphs) for now")
        return True, None, False
    if features.encoder_decoder and (
        cudagraph_mode is None or CUDAGraphMode.parse(cudagraph_mode) == CUDAGraphMode.NONE
    ):
        return True, cudagraph_mode, False
    return None


def resolve_engine_config(args: Any) -> EngineConfig:
    """`EngineArgs` -> `EngineConfig`: the model's config read, the feature table walked, and
    every derived setting (task, pooler, MoE, graph mode, ...) filled in, once."""
    from tokenwise.default_model import resolve_model_path

    warn_undeclared()
    device = args.device or default_device()
    enforce_eager, cudagraph_mode = args.enforce_eager, args.cudagraph_mode
    # CPU graphs (recorded C kernels) unless eagerness is asked for or a model kind rules it.
    cpu_graphs = enforce_eager is None
    if enforce_eager is None:
        # On CPU compiling costs 15+ s and gained only 3-16% in decode (docs/performance.md), so
        # eager is the default there; on GPU compilation is what makes the small kernels cheap.
        enforce_eager = not device.startswith("cuda")
    model_config = ModelConfig.from_pretrained(
        resolve_model_path(args.model),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        device=device,
        seed=args.seed,
        load_format=args.load_format,
        tokenizer=args.tokenizer,
        skip_tokenizer_init=args.skip_tokenizer_init,
        quantization=args.quantization,
    )
    archs = model_config.architectures
    num_labels = int(getattr(model_config.hf_config, "num_labels", 2))
    model_config.task = resolve_task(args.task, archs, num_labels)
    limit_mm = parse_limit_mm_per_prompt(args.limit_mm_per_prompt)
    speculative = None
    if args.speculative_config is not None:
        speculative = SpeculativeConfig.from_dict(args.speculative_config)
    features = Features(
        args=args,
        model=model_config,
        device=device,
        enforce_eager=enforce_eager,
        encoder_decoder=is_encoder_decoder_architecture(archs),
        multimodal=is_multimodal_architecture(archs, limit_mm),
        speculative=speculative,
    )
    check_features(features)
    if uses_cpu_kernels(model_config.quantization, device):
        cpu_qgemv.activation_bits()  # a bad TOKENWISE_CPU_QUANT_ACTIVATIONS fails here
        cpu_qgemv.fp32_activation_bits()  # and a bad ..._FP32_ACTIVATIONS
    if model_config.is_pooling:
        model_config.pooler_config = resolve_pooler_config(
            model_config.model, archs, args.override_pooler_config
        )
    # A text-only model refuses every image, whatever the limit says.
    model_config.limit_mm_per_prompt = limit_mm
    eager = _eager_kinds(features, cudagraph_mode)
    if eager is not None:
        enforce_eager, cudagraph_mode, cpu_graphs = eager
    if speculative is not None and speculative.method in ("eagle", "eagle3", "mtp"):
        cpu_graphs = False  # the head reads the target's hidden states eagerly
    is_moe = is_moe_architecture(archs)
    collectives = (args.data_parallel_size > 1 and is_moe) or args.tensor_parallel_size > 1
    collectives = collectives or args.pipeline_parallel_size > 1
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
    return EngineConfig(
        model=model_config,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            cache_dtype=args.kv_cache_dtype,
            num_gpu_blocks=args.num_gpu_blocks,
            enable_prefix_caching=args.enable_prefix_caching,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_offloading_size=args.kv_offloading_size,
            kv_offloading_backend=args.kv_offloading_backend,
            kv_offloading_dir=args.kv_offloading_dir,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_chunked_prefill=args.enable_chunked_prefill,
            policy=args.scheduling_policy,
            max_num_encoder_input_tokens=args.max_num_encoder_input_tokens,
            async_scheduling=args.async_scheduling,
        ),
        compilation=CompilationConfig(
            use_compile=not enforce_eager,
            cudagraph_mode=mode,
            cudagraph_capture_sizes=args.cudagraph_capture_sizes,
        ),
        parallel=_parallel_config(args, is_moe),
        device=device,
        lora=(
            LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)
            if args.enable_lora
            else None
        ),
        log_requests=not args.disable_log_requests,
        speculative=speculative,
        kv_events_config=_kv_events_config(args.kv_events_config, args.enable_prefix_caching),
        enable_sleep_mode=_sleep_mode(args.enable_sleep_mode, device),
    )


def _sleep_mode(enabled: bool, device: str) -> bool:
    """`enable_sleep_mode`, refused where it is not implemented (CUDA devices, for now)."""
    if enabled and not device.startswith("cpu"):
        raise ValueError(
            f"enable_sleep_mode is implemented for CPU engines only, not device={device!r}"
        )
    return enabled


def _kv_events_config(value: Any, enable_prefix_caching: bool) -> KVEventsConfig | None:
    """`kv_events_config`, refused without the prefix cache whose changes the events are."""
    config = KVEventsConfig.from_cli(value) if value is not None else None
    if config is not None and config.active and not enable_prefix_caching:
        raise ValueError(
            "kv_events_config enables KV-cache events, which report the prefix cache's "
            "contents, but prefix caching is off (--no-enable-prefix-caching): enable one "
            "without disabling the other"
        )
    return config


def _parallel_config(args: Any, is_moe: bool) -> ParallelConfig:
    """Parallel layout, with MoE known and the micro-batching thresholds applied."""
    for name in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold"):
        value = getattr(args, name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    decode = prefill = args.microbatching_token_threshold
    thresholds = {}
    if args.dbo_decode_token_threshold is not None:
        decode = args.dbo_decode_token_threshold
    if args.dbo_prefill_token_threshold is not None:
        prefill = args.dbo_prefill_token_threshold
    if decode is not None:
        thresholds["microbatching_decode_token_threshold"] = decode
    if prefill is not None:
        thresholds["microbatching_prefill_token_threshold"] = prefill
    return ParallelConfig(
        data_parallel_size=args.data_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        is_moe_model=is_moe,
        enable_expert_parallel=args.enable_expert_parallel,
        enable_microbatching=args.enable_microbatching or args.enable_dbo,
        data_parallel_master_ip=args.data_parallel_address or "127.0.0.1",
        data_parallel_master_port=args.data_parallel_port,
        data_parallel_size_local=args.data_parallel_size_local,
        data_parallel_start_rank=args.data_parallel_start_rank,
        data_parallel_rpc_port=args.data_parallel_rpc_port,
        distributed_executor_backend=args.distributed_executor_backend,
        ray_placement_strategy=args.ray_placement_strategy,
        data_parallel_backend=args.data_parallel_backend,
        **thresholds,
    )
