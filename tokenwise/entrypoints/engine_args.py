"""Engine flags and argparse validators shared by every CLI subcommand (generate, chat, serve,
bench).

They live here, in the engine package, rather than in `tokenwise.entrypoints`: the benchmarks
need the same flags, and the CLI registers the benchmarks, so a home under `entrypoints` would
make benchmarks and entrypoints import each other. Both now import this module from above.
Only the standard library is imported at module level (`tokenwise.config` lazily, when a flag
is parsed), so building a parser stays instant: no torch, no engine.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

from tokenwise.config import KV_CACHE_DTYPES

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)


def parse_memory_size(text: str) -> int:
    """Bytes from '1073741824', '512MiB', '2GB' or '1.5g' (binary units for the 'i' forms)."""
    match = _SIZE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use bytes or a unit such as 512MiB or 2GiB"
        )
    number = float(match.group(1))
    unit = (match.group(2) or "").lower().rstrip("b")  # "mib" -> "mi", "gb" -> "g"
    scale = 1
    if unit:
        power = "kmgt".index(unit[0]) + 1
        scale = 1024**power if unit.endswith("i") else 1000**power
    value = int(number * scale)
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def bounded_int(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse `type` accepting integers in [minimum, maximum] with a one-line error."""
    span = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer {span}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected an integer {span}, got {value}")
        return value

    return parse


positive_int = bounded_int(1)
non_negative_int = bounded_int(0)


def parse_json_dict(text: str) -> dict[str, Any]:
    """An argparse `type` for a JSON object flag (`--limit-mm-per-prompt '{"image": 2}'`)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def parse_cudagraph_mode(text: str) -> str:
    """A `CUDAGraphMode` name, any case; the error lists the valid names."""
    from tokenwise.config import CUDAGraphMode

    try:
        return CUDAGraphMode.parse(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_capture_sizes(text: str) -> list[int]:
    """Comma-separated token counts >= 1, e.g. '1,2,4,8,16'."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers >= 1 such as 1,2,4,8, got {text!r}"
        )
    return sorted(set(sizes))


def parse_speculative_config(text: str) -> Any:
    """A `SpeculativeConfig` from JSON such as '{"method": "ngram", "num_speculative_tokens": 4}'."""
    import json

    from tokenwise.config import SpeculativeConfig

    try:
        return SpeculativeConfig.from_dict(json.loads(text))
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(
            f"invalid speculative config {text!r} ({e}); expected JSON such as "
            '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\''
        ) from None


def parse_kv_events_config(text: str) -> Any:
    """A `KVEventsConfig` from JSON such as '{"enable_kv_cache_events": true}'."""
    from tokenwise.kv_cache.events_config import KVEventsConfig

    try:
        return KVEventsConfig.from_cli(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"invalid --kv-events-config {text!r}: {e}") from None


def parse_pooler_config(text: str) -> Any:
    """A `PoolerConfig` from JSON such as '{"pooling_type": "MEAN", "normalize": false}'."""
    import json

    from tokenwise.config import PoolerConfig

    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("expected a JSON object")
        return PoolerConfig(**fields)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(
            f"invalid pooler config {text!r} ({e}); expected JSON such as "
            '\'{"pooling_type": "MEAN", "normalize": true}\''
        ) from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="local Hugging Face checkpoint directory or GGUF file (default: the built-in model)",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory (default: the model's; for a GGUF file, its metadata's, "
        "where transformers can convert it)",
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["int8", "int4", "gguf", "fp8"],
        help="quantize the linear layers' weights on load, weight-only, per group of 32 (CPU): "
        "int8 or int4; gguf (the default for a .gguf file) keeps each tensor's bit width; fp8: "
        "float8 e4m3 per tensor (W8A8 on CUDA; also an fp8 checkpoint's own method)",
    )
    g.add_argument(
        "--limit-mm-per-prompt",
        type=parse_json_dict,
        default=None,
        metavar="JSON",
        help="most images one prompt may carry, as vLLM takes it: '{\"image\": 2}' "
        "(default: no limit)",
    )
    g.add_argument(
        "--max-num-encoder-input-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="image tokens a vision-language model's vision tower encodes per step at most; "
        "prompts stop before images that would pass it (default: --max-num-batched-tokens)",
    )
    g.add_argument(
        "--task",
        default="generate",
        choices=["auto", "generate", "embed", "score", "classify"],
        help="generate text; embed (encoder-only models such as BERT: /v1/embeddings); score "
        "(cross-encoders: /v1/score, /v1/rerank); classify (sequence classifiers: "
        "/v1/classify); auto = embed for encoder-only architectures, score or classify for "
        "classifiers with one or more labels (default: generate)",
    )
    g.add_argument(
        "--override-pooler-config",
        type=parse_pooler_config,
        default=None,
        metavar="JSON",
        help='pooling of an embed model, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' '
        "(default: the checkpoint's sentence-transformers config, else CLS + normalize)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weight/activation dtype; auto = bf16 on CPUs that support it, else fp32; "
        "the checkpoint's dtype on GPU",
    )
    g.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="longest prompt + output in tokens (default: the model's limit)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=128,
        help="most requests in one step (default: 128)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=2048,
        help="token budget of one step; longer prompts are chunked (default: 2048)",
    )
    g.add_argument(
        "--block-size",
        type=positive_int,
        default=16,
        help="tokens per KV-cache block (default: 16)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=parse_memory_size,
        default=None,
        help="KV cache size, e.g. 512MiB or 2GiB (default: on CPU 1GiB or what max-num-seqs "
        "full-length sequences need, if less; "
        "on GPU what --gpu-memory-utilization leaves after a profiling run; at least one "
        "max-model-len sequence)",
    )
    g.add_argument(
        "--num-gpu-blocks",
        type=positive_int,
        default=None,
        help="exact number of KV cache blocks (overrides --kv-cache-memory); the pool must "
        "hold one max-model-len sequence",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="dtype of the KV cache entries: auto (the model's dtype), bfloat16, or an fp8 "
        "format (fp8 = fp8_e4m3), which stores twice the tokens of a bf16 cache in the same "
        "memory (default: auto)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of total GPU memory the engine may use: the KV cache gets what a "
        "profiling run leaves of it (default: 0.9)",
    )
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "gguf", "dummy"],
        help="dummy = random weights from --seed, for benchmarks; auto = gguf for a .gguf "
        "file, else safetensors (default: auto)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_const",
        const=True,
        default=None,
        help="never use torch.compile or CUDA graphs (default on CPU, where compiling costs "
        "more than it gains for short runs)",
    )
    g.add_argument(
        "--compile",
        dest="enforce_eager",
        action="store_const",
        const=False,
        help="torch.compile the model (default on GPU)",
    )
    g.add_argument(
        "--cudagraph-mode",
        type=parse_cudagraph_mode,
        default=None,
        help="CUDA graphs: NONE, PIECEWISE, FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE "
        "(default: FULL_AND_PIECEWISE on GPU when compiling, NONE otherwise)",
    )
    g.add_argument(
        "--cudagraph-capture-sizes",
        type=parse_capture_sizes,
        default=None,
        metavar="N,N,...",
        help="token counts to capture graphs for (default: 1, 2, 4, then multiples of 8 up "
        "to --max-num-seqs)",
    )
    g.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="do not reuse KV blocks across requests",
    )
    g.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="fcfs serves requests in arrival order; priority by each request's `priority` "
        "(lower first, then arrival), preempting less urgent running requests when the KV "
        "cache or --max-num-seqs is full (default: fcfs)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="random seed of the engine and of dummy weights (default: 0)",
    )
    g.add_argument(
        "--device",
        default=None,
        choices=["cpu", "cuda"],
        help="device (default: cuda when available, else cpu)",
    )
    g.add_argument(
        "--speculative-config",
        type=parse_speculative_config,
        default=None,
        help="speculative decoding, as JSON with vLLM's names: "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 1}\' (n-gram prompt lookup), or \'{"model": "./draft", '
        '"num_speculative_tokens": 4}\' (a draft model with the same vocabulary), '
        '\'{"method": "eagle3", "model": "./eagle3-head", "num_speculative_tokens": 4}\' '
        '(an EAGLE / EAGLE-3 head), \'{"method": "mtp", "num_speculative_tokens": 1}\' '
        "(DeepSeek-V3's MTP module); "
        '"disable_by_batch_size": N stops proposing while N or more requests run',
    )
    g.add_argument(
        "--kv-events-config",
        type=parse_kv_events_config,
        default=None,
        help="publish KV-cache events (vLLM's format, ZeroMQ) for cluster routers, as JSON: "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
        '"tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558", "topic": '
        '"kv-events"}\'; an endpoint beyond loopback needs TOKENWISE_KV_EVENTS_SECRET',
    )
    p = parser.add_argument_group("parallelism (one process per rank)")
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=bounded_int(1),
        default=1,
        help="split each layer over this many processes; with torchrun, the number of "
        "processes torchrun starts (default: 1)",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=bounded_int(1),
        default=1,
        help="split the layers into this many stages, one process each, with as many batches "
        "in flight (dense Llama/Qwen models; TOKENWISE_PP_LAYER_PARTITION='4,4' sets the "
        "split; default: 1)",
    )
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=bounded_int(1),
        default=1,
        help="number of engine ranks; requests go to the least loaded (default: 1)",
    )
    p.add_argument(
        "--data-parallel-size-local",
        type=bounded_int(1),
        default=None,
        help="data-parallel ranks on this host, for ranks on several hosts (default: every "
        "rank from --data-parallel-start-rank on, i.e. all of them on one host)",
    )
    p.add_argument(
        "--data-parallel-start-rank",
        type=bounded_int(0),
        default=0,
        help="global rank of this host's first data-parallel rank: 0 on the front end's host, "
        "the first rank it runs on a --headless host (default: 0)",
    )
    p.add_argument(
        "--data-parallel-address",
        default=None,
        help="address of the first host, where the front end runs: the ranks rendezvous "
        "there (torch.distributed TCP store) and other hosts' ranks connect to it "
        "(default 127.0.0.1; required with --headless)",
    )
    p.add_argument(
        "--data-parallel-rpc-port",
        type=bounded_int(1, 65535),
        default=29550,
        help="port of the front end that the ranks of other hosts connect to (default 29550)",
    )
    p.add_argument(
        "--data-parallel-port",
        type=bounded_int(1, 65535),
        default=None,
        help="rendezvous port on the first host (default: a free port, which the front end "
        "tells the other hosts' ranks)",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE under DP: each rank holds whole experts instead of a slice of every expert",
    )
    p.add_argument(
        "--enable-microbatching",
        "--enable-dbo",
        dest="enable_microbatching",
        action="store_true",
        help="MoE under DP: run large steps as two micro-batches whose MoE exchanges overlap "
        "each other's compute (dual-batch overlap; --enable-dbo is vLLM's name)",
    )

    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters (PEFT directories)"
    )
    lora.add_argument(
        "--max-loras",
        type=bounded_int(1),
        default=1,
        help="adapters one step may mix; slots allocated at start-up (default: 1)",
    )
    lora.add_argument(
        "--max-lora-rank",
        type=bounded_int(1),
        default=16,
        help="largest adapter rank accepted (default: 16)",
    )
    lora.add_argument(
        "--max-cpu-loras",
        type=bounded_int(1),
        default=None,
        help="parsed adapters kept on the host (default: --max-loras)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments `LLM(...)` / `build_engine_config(...)` take, from parsed flags."""
    return {
        "dtype": args.dtype,
        "seed": args.seed,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "kv_cache_memory": args.kv_cache_memory,
        "kv_cache_dtype": args.kv_cache_dtype,
        "num_gpu_blocks": args.num_gpu_blocks,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "load_format": args.load_format,
        "tokenizer": getattr(args, "tokenizer", None),
        "enforce_eager": args.enforce_eager,
        "enable_prefix_caching": args.enable_prefix_caching,
        "device": args.device,
        "cudagraph_mode": args.cudagraph_mode,
        "cudagraph_capture_sizes": args.cudagraph_capture_sizes,
        "data_parallel_size": args.data_parallel_size,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "data_parallel_address": args.data_parallel_address,
        "data_parallel_port": args.data_parallel_port,
        "data_parallel_size_local": args.data_parallel_size_local,
        "data_parallel_start_rank": args.data_parallel_start_rank,
        "data_parallel_rpc_port": args.data_parallel_rpc_port,
        "enable_expert_parallel": args.enable_expert_parallel,
        "enable_microbatching": args.enable_microbatching,
        "enable_lora": args.enable_lora,
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "max_cpu_loras": args.max_cpu_loras,
        "task": getattr(args, "task", "generate"),
        "override_pooler_config": getattr(args, "override_pooler_config", None),
        # Only `serve` has the flag; the offline commands keep `LLM`'s default (off).
        "disable_log_requests": getattr(args, "disable_log_requests", True),
        "speculative_config": getattr(args, "speculative_config", None),
        "quantization": getattr(args, "quantization", None),
        "scheduling_policy": getattr(args, "scheduling_policy", "fcfs"),
        "limit_mm_per_prompt": getattr(args, "limit_mm_per_prompt", None),
        "max_num_encoder_input_tokens": getattr(args, "max_num_encoder_input_tokens", None),
        "kv_events_config": getattr(args, "kv_events_config", None),
    }


def add_request_log_args(parser: argparse.ArgumentParser) -> None:
    """`--disable-log-requests` (vLLM's name), for the server, where request lines are on."""
    parser.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="do not log one line per finished request (id, prompt and output tokens, time "
        "to first token, total time, finish reason; INFO on logger tokenwise.engine, shown with "
        "`tokenwise --log-level INFO serve`); the server logs them by default, the offline LLM "
        "(its disable_log_requests keyword defaults to True) and the generate/chat commands "
        "do not, so batch jobs are not flooded",
    )
