"""The flags of `tokenwise serve` beyond the shared engine flags.

Kept apart from the server so that building the CLI's parser imports neither FastAPI nor the
engine: `tokenwise --help` stays fast.
"""

from __future__ import annotations

import argparse
from typing import Any

from tokenwise import envs
from tokenwise.entrypoints.engine_args import (
    bounded_int,
    non_negative_int,
    parse_memory_size,
    positive_int,
)
from tokenwise.entrypoints.openai.reasoning import REASONING_PARSERS
from tokenwise.entrypoints.openai.server_config import (
    DEFAULT_HOST,
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_N,
    DEFAULT_MAX_PROMPTS,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_PORT,
    DEFAULT_RESPONSES_STORE_SIZE,
)
from tokenwise.entrypoints.openai.tool_parsers import TOOL_PARSERS

API_KEY_ENV = "TOKENWISE_API_KEY"


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to bind (default: {DEFAULT_HOST}; use 0.0.0.0 to accept other hosts)",
    )
    g.add_argument(
        "--port", type=bounded_int(1, 65535), default=DEFAULT_PORT, help=f"default: {DEFAULT_PORT}"
    )
    g.add_argument(
        "--api-key",
        default=envs.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV}, "
        "else no auth); the environment variable keeps the key out of the process list",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send and /v1/models lists (default: the --model value)",
    )
    g.add_argument(
        "--max-n",
        type=positive_int,
        default=DEFAULT_MAX_N,
        help=f"largest n (choices per request) accepted (default: {DEFAULT_MAX_N})",
    )
    g.add_argument(
        "--max-prompts",
        type=positive_int,
        default=DEFAULT_MAX_PROMPTS,
        help=f"most prompts in one batched completions request (default: {DEFAULT_MAX_PROMPTS})",
    )
    g.add_argument(
        "--max-logprobs",
        type=non_negative_int,
        default=DEFAULT_MAX_LOGPROBS,
        help=f"largest logprobs / top_logprobs accepted (default: {DEFAULT_MAX_LOGPROBS})",
    )
    g.add_argument(
        "--max-tokens-cap",
        type=positive_int,
        default=None,
        help="largest max_tokens accepted, and the limit when a request sets none "
        "(default: max_model_len)",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=parse_memory_size,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies get 413, e.g. 65536 or 4MiB (default: 1MiB)",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=positive_int,
        default=None,
        help="most requests waiting to be scheduled; a request beyond it gets 503 with "
        "Retry-After (default: no bound)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=5.0,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C: stop accepting connections, let in-flight requests finish "
        "for at most this long (then abort them), and exit 0 (default: 5)",
    )
    g.add_argument(
        "--strict-request-fields",
        action="store_true",
        help="refuse (400) request fields the server does not know; by default they are "
        "ignored and named in one warning per request, as vLLM does",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="return the <think> part of chat replies as reasoning_content (deepseek_r1: the "
        "reply starts inside the reasoning; qwen3: only where the model writes <think>; "
        "openai_gptoss: harmony's analysis channel); tool calls are read from the rest "
        "(default: off, the tags stay in the content; gpt-oss: openai_gptoss)",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how tool_choice 'auto' reads the calls a model writes (vLLM's names; hermes: "
        "<tool_call>{json}</tool_call>, llama3_json, mistral, qwen3_coder, deepseek_v3, "
        "pythonic, openai: gpt-oss's harmony) (default: hermes; gpt-oss: openai)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="as vLLM's flag: tool_choice 'auto' with --tool-call-parser (which it needs); "
        "tokenwise reads auto replies with the parser whether or not it is given",
    )
    g.add_argument(
        "--responses-store-size",
        type=non_negative_int,
        default=DEFAULT_RESPONSES_STORE_SIZE,
        metavar="N",
        help="keep the last N /v1/responses results in memory, for previous_response_id and "
        "GET /v1/responses/{id} (least recently used forgotten first; 0: keep none) "
        f"(default: {DEFAULT_RESPONSES_STORE_SIZE})",
    )
    g.add_argument(
        "--disable-access-log",
        "--disable-uvicorn-access-log",
        dest="disable_access_log",
        action="store_true",
        help="do not log one line per HTTP request (client, route, status, request id, prompt "
        "and output tokens, time; INFO on logger tokenwise.server.access, shown with "
        "`tokenwise --log-level INFO serve`); unlike the engine's line (--disable-log-requests), "
        "which is per engine request with its time to first token and finish reason, it covers "
        "every route and status, errors included",
    )
    g.add_argument(
        "--disable-ui",
        action="store_true",
        help="do not serve the web page at / (a chat playground and a live view of the "
        "engine's steps and KV cache) nor its data routes under /ui/",
    )
    g.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="let chat image_url parts name local files (file:// URLs or paths) under DIR "
        "(default: off; data: URLs always work)",
    )
    g.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="fetch chat image_url http(s) URLs only from these hosts (default: any host); "
        "TOKENWISE_IMAGE_FETCH_TIMEOUT (s, default 5) and TOKENWISE_IMAGE_FETCH_MAX_MB "
        "(default 20) bound each fetch",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served under these model names (needs "
        "--enable-lora); /v1/models lists them and a request picks one with its 'model' field",
    )
    g.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="open /v1/load_lora_adapter and /v1/unload_lora_adapter (off: adapters are fixed "
        "at start-up)",
    )


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def parse_lora_module(text: str) -> tuple[str, str]:
    """`name=path` of one `--lora-modules` entry."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def lora_modules_dict(pairs: list[tuple[str, str]] | None) -> dict[str, str]:
    modules: dict[str, str] = {}
    for name, path in pairs or []:
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules


def server_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """ServerConfig's keyword arguments from the parsed flags (name and length come later)."""
    return {
        "api_key": args.api_key,
        "max_n": args.max_n,
        "max_prompts": args.max_prompts,
        "max_logprobs": args.max_logprobs,
        "max_tokens_cap": args.max_tokens_cap,
        "max_request_body_bytes": args.max_request_body_bytes,
        "strict_request_fields": args.strict_request_fields,
        "reasoning_parser": args.reasoning_parser,
        "tool_call_parser": args.tool_call_parser,
        "enable_auto_tool_choice": args.enable_auto_tool_choice,
        "access_log": not args.disable_access_log,
        "ui": not args.disable_ui,
        "responses_store_size": args.responses_store_size,
        "allowed_local_media_path": args.allowed_local_media_path,
        "allowed_media_domains": args.allowed_media_domains,
    }
