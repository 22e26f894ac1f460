"""`tokenwise serve` whose tool-call parser a request may pick: one server for every family.

Starting a server per `--tool-call-parser` would cost half a minute each; this launcher runs
the real CLI (its `--tool-call-parser` is the default) and lets a request whose `user` field is
`tool-call-parser:NAME` be read with parser NAME instead, by swapping the chat endpoint's
config for that request. Tests send such requests one at a time:
`python -m tests.entrypoints._tool_parser_serve serve <args>`.
"""

from __future__ import annotations

import dataclasses
import sys

from tokenwise.entrypoints.cli import main
from tokenwise.entrypoints.openai.serving_chat import ChatServing

PREFIX = "tool-call-parser:"


def _picking(method):
    def wrapper(self, body):
        if body.user and body.user.startswith(PREFIX):
            name = body.user.removeprefix(PREFIX)
            self.config = dataclasses.replace(self.config, tool_call_parser=name)
        return method(self, body)

    return wrapper


# Planted in the server process only (the engine core never reads tool calls).
if __name__ == "__main__":
    ChatServing._prepare = _picking(ChatServing._prepare)  # type: ignore[method-assign]
    ChatServing.reader = _picking(ChatServing.reader)  # type: ignore[method-assign]
    sys.exit(main(sys.argv[1:]))
