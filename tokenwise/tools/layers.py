"""The layers of tokenwise, lowest first: the order `check_layers` proves the imports follow.

A new module gets its place here on purpose (a module no pattern matches is an error); see
`check_layers.py` for the rules.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layer:
    """A named set of module patterns: `a.b` is that module, `a.b.*` it and all below it."""

    name: str
    patterns: tuple[str, ...]


# Lowest first: a module may import its own layer and the layers above it in this list.
LAYERS: tuple[Layer, ...] = (
    # Plain settings and records with no tokenwise dependency; and this checker, which must
    # keep working when the rest of the package does not import. The GGUF readers are here
    # too (metadata -> a transformers config, tensors -> HF names, the tokenizer): they need
    # nothing else of tokenwise, and the model configuration reads them.
    Layer(
        "foundation",
        (
            "tokenwise.config",
            "tokenwise.compilation_config",
            "tokenwise.config_checks",
            "tokenwise.speculative_config",
            "tokenwise.gguf.*",
            "tokenwise.quantization_config",
            "tokenwise.model_config",
            "tokenwise.platform",
            "tokenwise.outputs",
            "tokenwise.default_model",
            "tokenwise.envs",
            "tokenwise.batchsize_stats",
            "tokenwise.tools.*",
            # KV-cache specs and groups: plain data the layers declare and the runner and the
            # block manager both read.
            "tokenwise.kv_cache",
            "tokenwise.kv_cache.specs",
            "tokenwise.kv_cache.layout",
            "tokenwise.kv_cache.hashing",
            # KV-cache events: the wire structs and `--kv-events-config` (msgspec, no engine).
            "tokenwise.kv_cache.events",
            "tokenwise.kv_cache.events_config",
            # The second KV tier's stores and its connector to the cache tensors (torch only).
            "tokenwise.kv_cache.tier",
            "tokenwise.kv_cache.tier_disk",
            "tokenwise.kv_cache.tier_blocks",
            "tokenwise.kv_cache.tier_loads",
        ),
    ),
    # The C kernels of CPU decode, their ctypes wrappers and build: tensors and plain settings
    # in, tensors out; the layers, attention backends and CPU graphs call them.
    Layer("native kernels", ("tokenwise.native.*",)),
    # Tensor-parallel rank, size and collectives: what parallel layers read at construction;
    # the pipeline stage and its layer range, which models read at construction.
    Layer(
        "process groups",
        (
            "tokenwise.distributed.rendezvous",
            "tokenwise.distributed.tp_state",
            "tokenwise.distributed.pp_state",
        ),
    ),
    # Plain PyTorch building blocks and weight-copy helpers: no engine state, no context.
    Layer("layers", ("tokenwise.layers.*",)),
    # The DP group and batch coordination, which the forward context calls into.
    Layer("distributed", ("tokenwise.distributed.*",)),
    # Per-pass context and the static layer registry the attention layers enter themselves in.
    Layer("forward context", ("tokenwise.forward_context", "tokenwise.layer_registry")),
    # The MoE layer: under DP it reads the step's token counts from the forward context and
    # exchanges tokens through `distributed`, so it sits above both (the rest of `layers` not).
    # Its dispatch/combine lives in `distributed` by topic but reads DPMetadata, so it is here.
    Layer("MoE layer", ("tokenwise.layers.fused_moe.*", "tokenwise.distributed.moe_dispatch")),
    Layer("attention utils", ("tokenwise.attention", "tokenwise.attention.utils")),
    # Batch structure for attention and the persistent graph buffers: what backends consume.
    Layer(
        "attention metadata",
        (
            "tokenwise.attention.metadata",
            "tokenwise.attention.graph_state",
            "tokenwise.attention.ubatch_metadata",
        ),
    ),
    # Tensor-only kernels: they receive tensors, metadata and plain settings, never the layer.
    Layer("attention backends", ("tokenwise.attention.backends.*",)),
    Layer(
        "attention layer",
        (
            "tokenwise.attention.layer",
            "tokenwise.attention.mla",
            "tokenwise.attention.recurrent",
            "tokenwise.attention.kv_scales",
        ),
    ),
    Layer("models", ("tokenwise.models.*",)),
    # Resolves the model class from the registry, so it sits above the models.
    Layer("loader", ("tokenwise.loader",)),
    # Adapter slots attached to a built model's linear layers, and the PEFT reader.
    Layer("LoRA", ("tokenwise.lora.*",)),
    # Sampling, and speculative decoding's proposers (token ids in, draft token ids out).
    Layer("sampling", ("tokenwise.sampling.*", "tokenwise.spec_decode.*")),
    # Embedding models: pooling parameters and the pooler; the task check reads the registry.
    Layer("pooling", ("tokenwise.pooling.*",)),
    Layer("compilation", ("tokenwise.compilation.*",)),
    # What the scheduler owns and hands the runner: requests, block tables, stop rules, the
    # step's records; and the model kinds' request-side pieces below the runner that reads
    # them (their request types, encoder inputs, their schedulers).
    Layer(
        "requests and scheduling",
        (
            "tokenwise.engine",
            "tokenwise.engine.request",
            "tokenwise.engine.step_outputs",
            "tokenwise.engine.block_pool",
            "tokenwise.kv_cache.managers",
            "tokenwise.kv_cache.invariants",
            "tokenwise.engine.block_manager",
            "tokenwise.engine.kv_tier_setup",
            "tokenwise.engine.request_queue",
            "tokenwise.engine.scheduler_hooks",
            "tokenwise.engine.kv_tier_waits",
            "tokenwise.engine.grammar_waits",
            "tokenwise.engine.scheduler",
            "tokenwise.engine.step_apply",
            "tokenwise.engine.async_scheduler",
            "tokenwise.engine.stop_rules",
            "tokenwise.engine.detokenizer",
            "tokenwise.engine.prompts",
            "tokenwise.engine.stats",
            "tokenwise.engine.step_records",
            "tokenwise.engine.output_processor",
            "tokenwise.engine.drafter",
            "tokenwise.engine.virtual_engines",
            "tokenwise.engine.kinds",
            "tokenwise.engine.kinds.encoder_inputs",
            "tokenwise.engine.kinds.image_inputs",
            "tokenwise.engine.kinds.requests",
            "tokenwise.engine.kinds.audio",
            "tokenwise.engine.kinds.pooling_scheduler",
            "tokenwise.engine.kinds.encoder_decoder_scheduler",
        ),
    ),
    # The TP workers' processes and the per-step channel to them, which carries the runner's
    # step inputs: the runner drives both.
    # Pipeline stages are spawned the same way; their channel carries activations between them.
    Layer(
        "tensor-parallel launch",
        (
            "tokenwise.distributed.tp_launch",
            "tokenwise.distributed.pp_launch",
            "tokenwise.distributed.pp_channel",
        ),
    ),
    # Input batch, model runner, CUDA graphs, KV cache sizing: a scheduled step to sampled
    # tokens. The TP channel sends the runner's step inputs, so it lives beside them.
    Layer(
        "runner",
        (
            "tokenwise.runner.*",
            "tokenwise.distributed.tp_channel",
            "tokenwise.distributed.step_message",
        ),
    ),
    # Executor -> worker -> runner: the executor owns an engine's workers (this process's and
    # the ranks it spawns); a worker owns its device, its groups and one runner; the other
    # ranks' entry point (spawned or torchrun) builds theirs. The engine constructors call it
    # (a torchrun rank other than 0 turns into a worker before any engine).
    Layer("executor", ("tokenwise.executor.*",)),
    # Model kinds as strategies (generate, embed, encoder-decoder): each names its runner and
    # scheduler and supplies prompt processing, KV-cache groups and outputs to the one loop.
    Layer("model kinds", ("tokenwise.engine.kinds.*",)),
    # Pipeline parallelism's loop: P micro-batches in flight over the virtual engines.
    Layer("pipeline loop", ("tokenwise.engine.pipeline_loop",)),
    # The engine loop: the same for every kind.
    Layer(
        "engine loop",
        (
            "tokenwise.engine.sleep_control",
            "tokenwise.engine.async_step",
            "tokenwise.engine.llm_engine",
            "tokenwise.engine.speculative_setup",
        ),
    ),
    # Engines callers drive (`EngineClient`): the in-process engine, and the client of
    # engine-core processes (one, or one per DP rank, some of them on other hosts or Ray
    # actors) with its wire messages; `create_engine` picks one.
    Layer(
        "engine clients",
        (
            "tokenwise.engine.core_messages",
            "tokenwise.engine.remote_control",
            "tokenwise.engine.remote_ranks",
            "tokenwise.engine.core_sockets",
            "tokenwise.engine.core_process",
            "tokenwise.engine.core_processes",
            "tokenwise.engine.remote_core",
            "tokenwise.engine.ray_ranks",
            "tokenwise.engine.headless",
            "tokenwise.engine.core_client",
            "tokenwise.engine.client",
        ),
    ),
    # Beam search over any engine's one-token steps: `LLM.beam_search` and the server drive it.
    Layer("beam search", ("tokenwise.entrypoints.beam_search",)),
    # Score / classify requests (text pairs, probabilities): `LLM.score` and the server share it.
    Layer("scoring", ("tokenwise.entrypoints.scoring",)),
    # The offline `LLM` API: what the benchmarks run.
    # Settings resolved against the model into an `EngineConfig`, with the feature table.
    Layer(
        "engine configuration",
        ("tokenwise.entrypoints.feature_rules", "tokenwise.entrypoints.engine_config"),
    ),
    # `EngineArgs`, where each setting is declared once, and the flags every CLI (and
    # benchmark) generates from it; `create_engine_config` calls the layer below.
    Layer(
        "engine arguments",
        (
            "tokenwise.entrypoints.arg_types",
            "tokenwise.entrypoints.engine_flags",
            "tokenwise.entrypoints.parallel_args",
            "tokenwise.entrypoints.engine_args",
        ),
    ),
    Layer("offline API", ("tokenwise.entrypoints.llm",)),
    # Benchmarks run `LLM`, and the CLI below registers them: they sit between the two.
    Layer("benchmarks", ("tokenwise.benchmarks.*",)),
    Layer("CLI and server", ("tokenwise.entrypoints.*", "tokenwise.ray_serve")),
    # `tokenwise/__init__.py` lazily re-exports `LLM` and friends; nothing imports it back.
    Layer("package facade", ("tokenwise",)),
)
