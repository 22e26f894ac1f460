"""`tokenwise bench {throughput,latency,serve}`: the engine's own benchmarks.

- throughput: offline, a fixed batch of random requests through `LLM.generate`.
- latency: one batch repeatedly; the distribution of its end-to-end time.
- serve: a load generator for a running OpenAI-compatible server (TTFT, TPOT, ITL).

Only argument definitions are imported here, so `tokenwise bench --help` and argument errors
stay instant; each command imports torch and the engine when it runs.

Layering (`tokenwise.tools.check_layers`): the benchmarks sit above the offline `LLM` API
(`tokenwise.entrypoints.llm`), which throughput and latency run, and below the CLI, which
registers them here. Their engine flags come from `tokenwise.entrypoints.engine_args`, never from the
CLI's modules, so the two never import each other.
"""

from __future__ import annotations

import argparse

_COMMANDS = {
    "throughput": "offline throughput of a batch of random requests",
    "latency": "end-to-end latency of one batch, repeated",
    "serve": "load a running server with streaming requests (TTFT, TPOT, ITL)",
}


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    """Add `bench` with one sub-subcommand per benchmark to the top-level `tokenwise` parser."""
    from tokenwise.benchmarks import latency, serve, throughput

    modules = {"throughput": throughput, "latency": latency, "serve": serve}
    bench = subparsers.add_parser(
        "bench",
        help="benchmark throughput, latency or a running server",
        description="Benchmark tokenwise. Prompts are random token ids, greedy, EOS ignored.",
    )
    commands = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    commands.required = True
    for name, summary in _COMMANDS.items():
        module = modules[name]
        parser = commands.add_parser(
            name,
            help=summary,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(parser)
        parser.set_defaults(func=module.run)
