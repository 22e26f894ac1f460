"""`EngineArgs`: every engine setting declared once, and the CLI flags generated from it.

A setting is one dataclass field: its name is the `LLM(...)` keyword (vLLM's), its default is
the default everywhere, and its metadata holds the help text and the command-line spelling.
`add_engine_args` turns the fields into the argparse flags of `tokenwise generate`, `chat`,
`serve`, `run-batch` and the benchmarks; `engine_kwargs` turns parsed flags back into keywords;
`EngineArgs.create_engine_config()` resolves them against the model and the device into the
`EngineConfig` the engine is built from (`engine_config.py`). Adding a setting is therefore one
field here plus the code that reads it; `tests/entrypoints/test_engine_args_walk.py` proves
that the CLI, `LLM(...)` and the server accept each field under the same name and default.

It lives under `entrypoints/` because resolving a config needs the model registry and the
quantization and pooling rules (layers the engine package sits below). Module level imports
only the standard library and `tokenwise.config` (plain dataclasses), so building a parser
stays instant: no torch, no engine.
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass, fields
from typing import Any

from tokenwise.config import (
    KV_CACHE_DTYPES,
    KV_OFFLOADING_BACKENDS,
    EngineConfig,
    PoolerConfig,
    SpeculativeConfig,
)
from tokenwise.entrypoints.arg_types import (  # noqa: F401 (re-exported: the flags' parsers)
    bounded_int,
    non_negative_int,
    parse_capture_sizes,
    parse_cudagraph_mode,
    parse_json_dict,
    parse_kv_events_config,
    parse_memory_size,
    parse_pooler_config,
    parse_speculative_config,
    positive_int,
)
from tokenwise.entrypoints.engine_flags import (
    ALL_COMMANDS,
    SERVE_ONLY,
    add_flags,
    flag_values,
    setting,
)
from tokenwise.entrypoints.parallel_args import ParallelArgs

LORA = "LoRA adapters"


@dataclass
class EngineArgs(ParallelArgs):
    """The settings an engine is built from, with vLLM's names; see the module docstring.
    The parallelism settings are declared in `ParallelArgs` (`parallel_args.py`)."""

    model: str | None = setting(
        None,
        "local Hugging Face checkpoint directory or GGUF file (default: the built-in model)",
    )
    tokenizer: str | None = setting(
        None,
        "tokenizer directory (default: the model's; for a GGUF file, its metadata's, "
        "where transformers can convert it)",
    )
    skip_tokenizer_init: bool = setting(
        False,
        "load no tokenizer: prompts are token ids and outputs carry no text (benchmarks); "
        "the server refuses it",
    )
    quantization: str | None = setting(
        None,
        "quantize the linear layers' weights on load, weight-only, per group of 32 (CPU): "
        "int8 or int4; gguf (the default for a .gguf file) keeps each tensor's bit width; fp8: "
        "float8 e4m3 per tensor (W8A8 on CUDA; also an fp8 checkpoint's own method)",
        flags=("--quantization", "-q"),
        choices=["int8", "int4", "gguf", "fp8"],
    )
    limit_mm_per_prompt: dict[str, int] | None = setting(
        None,
        "most images (and videos: Qwen3.5) one prompt may carry, as vLLM takes it: "
        '\'{"image": 2, "video": 1}\' (default: no limit)',
        type=parse_json_dict,
        metavar="JSON",
    )
    max_num_encoder_input_tokens: int | None = setting(
        None,
        "image tokens a vision-language model's vision tower encodes per step at most; "
        "prompts stop before images that would pass it (default: --max-num-batched-tokens)",
        type=positive_int,
        metavar="N",
    )
    task: str = setting(
        "generate",
        "generate text; embed (encoder-only models such as BERT: /v1/embeddings); score "
        "(cross-encoders: /v1/score, /v1/rerank); classify (sequence classifiers: "
        "/v1/classify); auto = embed for encoder-only architectures, score or classify for "
        "classifiers with one or more labels (default: generate)",
        choices=["auto", "generate", "embed", "score", "classify"],
    )
    override_pooler_config: PoolerConfig | None = setting(
        None,
        'pooling of an embed model, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' '
        "(default: the checkpoint's sentence-transformers config, else CLS + normalize)",
        type=parse_pooler_config,
        metavar="JSON",
    )
    dtype: Any = setting(
        "auto",
        "weight/activation dtype; auto = bf16 on CPUs that support it, else fp32; "
        "the checkpoint's dtype on GPU",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    max_model_len: int | None = setting(
        None,
        "longest prompt + output in tokens (default: the model's limit)",
        type=positive_int,
    )
    max_num_seqs: int = setting(128, "most requests in one step (default: 128)", type=positive_int)
    max_num_batched_tokens: int = setting(
        2048,
        "token budget of one step; longer prompts are chunked (default: 2048)",
        type=positive_int,
    )
    enable_chunked_prefill: bool = setting(
        True,
        "split prompts longer than --max-num-batched-tokens over several steps (default: on)",
    )
    block_size: int = setting(16, "tokens per KV-cache block (default: 16)", type=positive_int)
    kv_cache_memory: int | None = setting(
        None,
        "KV cache size, e.g. 512MiB or 2GiB (default: on CPU 1GiB or what max-num-seqs "
        "full-length sequences need, if less; on GPU what --gpu-memory-utilization leaves "
        "after a profiling run; at least one max-model-len sequence)",
        type=parse_memory_size,
    )
    num_gpu_blocks: int | None = setting(
        None,
        "exact number of KV cache blocks (overrides --kv-cache-memory); the pool must "
        "hold one max-model-len sequence",
        type=positive_int,
    )
    kv_cache_dtype: str = setting(
        "auto",
        "dtype of the KV cache entries: auto (the model's dtype), bfloat16, or an fp8 "
        "format (fp8 = fp8_e4m3), which stores twice the tokens of a bf16 cache in the same "
        "memory (default: auto)",
        choices=list(KV_CACHE_DTYPES),
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "fraction of total GPU memory the engine may use: the KV cache gets what a "
        "profiling run leaves of it (default: 0.9)",
        type=float,
    )
    load_format: str = setting(
        "auto",
        "dummy = random weights from --seed, for benchmarks; auto = gguf for a .gguf "
        "file, else safetensors (default: auto)",
        choices=["auto", "safetensors", "gguf", "dummy"],
    )
    enforce_eager: bool | None = setting(
        None,
        "never use torch.compile or CUDA graphs (default on CPU, where compiling costs "
        "more than it gains for short runs)",
        const=True,
        extra_flags=(
            (
                ("--compile",),
                {
                    "action": "store_const",
                    "const": False,
                    "help": "torch.compile the model (default on GPU)",
                },
            ),
        ),
    )
    cudagraph_mode: Any = setting(
        None,
        "CUDA graphs: NONE, PIECEWISE, FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE "
        "(default: FULL_AND_PIECEWISE on GPU when compiling, NONE otherwise)",
        type=parse_cudagraph_mode,
    )
    cudagraph_capture_sizes: list[int] | None = setting(
        None,
        "token counts to capture graphs for (default: 1, 2, 4, then multiples of 8 up "
        "to --max-num-seqs)",
        type=parse_capture_sizes,
        metavar="N,N,...",
    )
    enable_prefix_caching: bool = setting(True, "reuse KV blocks across requests (default: on)")
    kv_offloading_size: float | None = setting(
        None,
        "GiB of a second tier for prefix-cache blocks evicted from the KV cache, loaded back "
        "on a later prefix hit (default: off)",
        type=float,
        metavar="GIB",
    )
    kv_offloading_backend: str = setting(
        "native",
        "the tier's store: native = pinned host memory on CUDA, files on local disk on CPU; "
        "cpu or disk name one (default: native)",
        choices=list(KV_OFFLOADING_BACKENDS),
    )
    kv_offloading_dir: str | None = setting(
        None,
        "root directory of the disk tier, one subdirectory per model "
        "(default: $XDG_CACHE_HOME/tokenwise/kv-tier)",
    )
    scheduling_policy: str = setting(
        "fcfs",
        "fcfs serves requests in arrival order; priority by each request's `priority` "
        "(lower first, then arrival), preempting less urgent running requests when the KV "
        "cache or --max-num-seqs is full (default: fcfs)",
        choices=["fcfs", "priority"],
    )
    async_scheduling: bool = setting(
        False,
        "schedule step N+1 while step N runs, with a placeholder for each token in flight, "
        "and process step N's outputs meanwhile (text decoders on one rank; default: off)",
    )
    seed: int = setting(0, "random seed of the engine and of dummy weights (default: 0)", type=int)
    device: str | None = setting(
        None,
        "device (default: cuda when available, else cpu)",
        choices=["cpu", "cuda"],
    )
    speculative_config: dict[str, Any] | SpeculativeConfig | None = setting(
        None,
        "speculative decoding, as JSON with vLLM's names: "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 1}\' (n-gram prompt lookup), \'{"method": "suffix"}\' (suffix '
        "decoding: suffix_decoding_max_tree_depth, _max_cached_requests, _max_spec_factor, "
        '_min_token_prob), or \'{"model": "./draft", '
        '"num_speculative_tokens": 4}\' (a draft model with the same vocabulary), '
        '\'{"method": "eagle3", "model": "./eagle3-head", "num_speculative_tokens": 4}\' '
        '(an EAGLE / EAGLE-3 head), \'{"method": "mtp", "num_speculative_tokens": 1}\' '
        "(DeepSeek-V3's MTP module); "
        '"disable_by_batch_size": N stops proposing while N or more requests run',
        type=parse_speculative_config,
    )
    kv_events_config: Any = setting(
        None,
        "publish KV-cache events (vLLM's format, ZeroMQ) for cluster routers, as JSON: "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
        '"tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558", "topic": '
        '"kv-events"}\'; an endpoint beyond loopback needs TOKENWISE_KV_EVENTS_SECRET',
        type=parse_kv_events_config,
    )
    disable_log_requests: bool = setting(
        True,
        "do not log one line per finished request (id, prompt and output tokens, time "
        "to first token, total time, finish reason; INFO on logger tokenwise.engine, shown with "
        "`tokenwise --log-level INFO serve`); the server logs them by default, the offline LLM "
        "(its disable_log_requests keyword defaults to True) and the generate/chat commands "
        "do not, so batch jobs are not flooded",
        commands=SERVE_ONLY,
        cli_default=False,
    )
    enable_sleep_mode: bool = setting(
        False,
        "allow sleep(level=1|2) / wake_up: level 1 writes the weights to a temporary file and "
        "hands their memory and the KV cache's back to the system, level 2 discards the "
        "weights (reload or push new ones before serving); CPU engines (default: off)",
    )
    enable_lora: bool = setting(False, "serve LoRA adapters (PEFT directories)", group=LORA)
    max_loras: int = setting(
        1,
        "adapters one step may mix; slots allocated at start-up (default: 1)",
        type=bounded_int(1),
        group=LORA,
    )
    max_lora_rank: int = setting(
        16, "largest adapter rank accepted (default: 16)", type=bounded_int(1), group=LORA
    )
    max_cpu_loras: int | None = setting(
        None,
        "parsed adapters kept on the host (default: --max-loras)",
        type=bounded_int(1),
        group=LORA,
    )

    def __post_init__(self) -> None:
        if self.enable_dbo:  # vLLM's name for the same switch (dual-batch overlap)
            self.enable_microbatching = True

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The settings parsed by `add_engine_args` (a command's missing flags: defaults)."""
        return cls(model=getattr(args, "model", None), **engine_kwargs(args))

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineArgs:
        """`LLM(model, **kwargs)`'s settings; an unknown keyword is a TypeError naming it."""
        known = {f.name for f in fields(cls)}
        for name in kwargs:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"unknown engine argument {name!r}{hint}")
        return cls(model=model, **kwargs)

    def create_engine_config(self) -> EngineConfig:
        """The `EngineConfig` these settings give for their model and device: every derived
        field (model kind, MoE, graph mode, ...) is filled in here, once, and the feature
        table (`feature_rules.py`) refuses what does not combine."""
        from tokenwise.entrypoints.engine_config import resolve_engine_config

        return resolve_engine_config(self)


def build_engine_config(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """`EngineArgs(model=model, **kwargs).create_engine_config()`: the keyword form that
    `LLM(...)`, the server and the tests use."""
    return EngineArgs.from_kwargs(model, **kwargs).create_engine_config()


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every engine setting's flag, generated from `EngineArgs`, for any command."""
    add_flags(parser, EngineArgs, ALL_COMMANDS)


def add_request_log_args(parser: argparse.ArgumentParser) -> None:
    """`--disable-log-requests` (vLLM's name), for the server, where request lines are on."""
    add_flags(parser, EngineArgs, SERVE_ONLY)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments `LLM(...)` / `build_engine_config(...)` take, from parsed flags
    (every setting but `model`, which callers pass first; a flag the command lacks keeps
    `LLM`'s default, e.g. `disable_log_requests` outside `serve`)."""
    return flag_values(args, EngineArgs, skip=("model",))
