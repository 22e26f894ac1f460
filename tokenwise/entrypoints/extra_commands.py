"""Subcommands beyond generate/chat (serve, bench) register here as they are added."""

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
    add_server_args(serve)
    add_engine_args(serve)
    add_request_log_args(serve)
    serve.set_defaults(func=_run_serve)

    from tokenwise.benchmarks import register_bench

    register_bench(subparsers)


def _run_serve(args: argparse.Namespace) -> int:
    from tokenwise.entrypoints.openai.api_server import run_server

    return run_server(args)
