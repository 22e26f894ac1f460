"""Subcommands beyond generate/chat (serve, run-batch, bench) register here as they are added."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the optional subcommands; each imports its heavy dependencies lazily."""
    from tokenwise.entrypoints.engine_args import add_engine_args, add_request_log_args
    from tokenwise.entrypoints.openai.cli_args import add_server_args

    serve = subparsers.add_parser(
        "serve",
        help="run an OpenAI-compatible HTTP server",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
        "/detokenize, /health, /ping, /version and /metrics for one model.",
    )
    serve.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model (checkpoint directory or GGUF file), as vLLM takes it; same as --model",
    )
    add_server_args(serve)
    add_engine_args(serve)
    add_request_log_args(serve)
    serve.add_argument(
        "--headless",
        action="store_true",
        help="data parallelism across hosts: run only this host's engine cores (ranks "
        "--data-parallel-start-rank .. + --data-parallel-size-local), no API server; they "
        "connect to the front end at --data-parallel-address:--data-parallel-rpc-port",
    )
    serve.set_defaults(func=_run_serve)

    from tokenwise.entrypoints.run_batch import add_run_batch_parser

    add_run_batch_parser(subparsers)

    from tokenwise.benchmarks import register_bench

    register_bench(subparsers)


def _run_serve(args: argparse.Namespace) -> int:
    if args.headless:
        return _run_headless(resolve_model_tag(args))
    from tokenwise.entrypoints.openai.api_server import run_server

    return run_server(resolve_model_tag(args))


def _run_headless(args: argparse.Namespace) -> int:
    """`serve --headless`: this host's engine cores only (`tokenwise.engine.headless`)."""
    from tokenwise.engine.headless import check_headless, run_headless
    from tokenwise.entrypoints.engine_args import EngineArgs

    config = EngineArgs.from_cli_args(args).create_engine_config()
    check_headless(config.parallel, args.data_parallel_address is not None)
    return run_headless(config)


def resolve_model_tag(args: argparse.Namespace) -> argparse.Namespace:
    """`serve MODEL` (vLLM's form) sets `--model`; giving two different models is an error."""
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            raise ValueError(f"two models given: {tag!r} and --model {args.model!r}")
        args.model = tag
    return args
