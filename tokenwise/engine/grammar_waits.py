"""The scheduler's side of guided decoding: waiting requests whose grammars still compile.

A guided request waits in the queue until its grammar is compiled (on xgrammar's threads, see
`sampling/guided/`); a compile that fails or runs late ends the request with its error.
Apart from `scheduler.py` (placement) because it is only this wait; without guided requests
every hook is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from tokenwise.engine.request import Request, RequestStatus


class GrammarWaits:
    """Mixed into the scheduler, which provides `waiting` and `finish_requests`."""

    waiting: Iterable[Request]
    finish_requests: Callable[[Any, RequestStatus], None]

    def poll_grammars(self) -> None:
        """Make matchers for compiled grammars; end requests whose compile failed or is late."""
        failed = [
            r
            for r in self.waiting
            if r.grammar is not None and not r.grammar.poll() and r.grammar.error is not None
        ]
        for req in failed:
            assert req.grammar is not None
            req.error = req.grammar.error
        if failed:
            self.finish_requests(failed, RequestStatus.FINISHED_ERROR)

    def grammar_futures(self) -> list[Future]:
        """The compiles that waiting requests wait for."""
        return [
            r.grammar.compiled
            for r in self.waiting
            if r.grammar is not None and not r.grammar.ready
        ]
