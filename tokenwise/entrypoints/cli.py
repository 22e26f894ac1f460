"""The `tokenwise` command: generate, chat (and serve, bench).

Every user error (missing model directory, bad flag value, invalid sampling parameter) ends the
process with a one-line message and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenwise import envs

if TYPE_CHECKING:
    from tokenwise.sampling.params import SamplingParams

envs.set_default("TOKENIZERS_PARALLELISM", "false")

USER_ERRORS = (ValueError, FileNotFoundError, TypeError, NotImplementedError)


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off (default: 0)")
    g.add_argument("--min-p", type=float, default=0.0, help="0 = off (default: 0)")
    g.add_argument("--n", type=int, default=1, help="completions per prompt (default: 1)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from tokenwise.sampling.params import SamplingParams

    return SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,  # --seed makes sampled output reproducible run to run
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def build_parser() -> argparse.ArgumentParser:
    from tokenwise.entrypoints.engine_args import add_engine_args

    parser = argparse.ArgumentParser(
        prog="tokenwise",
        description="tokenwise: a readable LLM inference engine for CPU and GPU.",
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default: WARNING)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    gen = sub.add_parser(
        "generate",
        help="complete prompts given on the command line",
        description="Complete each PROMPT and print the completions.",
    )
    gen.add_argument(
        "prompts",
        nargs="*",
        metavar="PROMPT",
        help="prompts to complete (default: read one prompt per line from stdin)",
    )
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    _add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=_run_generate)

    chat = sub.add_parser(
        "chat",
        help="interactive chat (plain continuation without a template)",
        description="Chat interactively; /exit or Ctrl-D quits.",
    )
    _add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=_run_chat)

    from tokenwise.entrypoints import extra_commands

    extra_commands.register(sub)
    return parser


def _run_generate(args: argparse.Namespace) -> int:
    from tokenwise.entrypoints.generate import run_generate

    return run_generate(args, _sampling_params(args))


def _run_chat(args: argparse.Namespace) -> int:
    from tokenwise.entrypoints.chat import run_chat

    return run_chat(args, _sampling_params(args))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(levelname)s %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except USER_ERRORS as exc:
        print(f"tokenwise: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tokenwise: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
