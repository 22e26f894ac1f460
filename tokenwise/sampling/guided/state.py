"""One request's place in its grammar: an xgrammar matcher, created once the compile is done.

The scheduler owns this state like the rest of the request: `poll` (is the grammar ready,
failed, or too slow?) before it schedules the request, `accept` with each sampled token in
`update_from_output`. The runner only reads it to mask the logits (`fill_bitmask`; with
speculative drafts `fill_draft_bitmasks`, which advances over the drafts and rolls back).

Preemption needs no rollback: a preempted request keeps its output tokens and recomputes their
K/V (see `tokenwise.engine.scheduler`), so the matcher, which has accepted exactly those
tokens, is still right when the request runs again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

import torch
import xgrammar

from tokenwise.sampling.guided.grammar import clean_error

# Every error a request's grammar ends it with starts so: the fault is the request's spec (too
# slow or impossible to compile), which a server reports as the client's (400), not its own.
GRAMMAR_ERROR_PREFIX = "guided_decoding:"


class GrammarState:
    """The matcher of one sequence (each of the n samples of a request has its own).

    `clock` (seconds, monotonic; `time.monotonic` by default) measures the compile timeout;
    tests pass a fake one so that the timeout does not depend on the real clock."""

    def __init__(
        self,
        compiled: Future,
        stop_token_ids: tuple[int, ...],
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.compiled = compiled
        self.stop_token_ids = list(stop_token_ids)
        self.timeout_s = timeout_s
        self.clock = clock
        self.submitted_at = clock()
        self.matcher: xgrammar.GrammarMatcher | None = None
        self.error: str | None = None

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    def poll(self) -> bool:
        """True once the matcher exists. False while compiling, or (with `error` set) when the
        compile failed or has taken longer than `timeout_s`; such a request must end."""
        if self.matcher is not None:
            return True
        if self.error is not None:
            return False
        if not self.compiled.done():
            waited = self.clock() - self.submitted_at
            if waited > self.timeout_s:
                self.error = (
                    f"{GRAMMAR_ERROR_PREFIX} the grammar did not compile within {self.timeout_s:g} s "
                    "(TOKENWISE_GRAMMAR_COMPILE_TIMEOUT_S); simplify the schema or grammar"
                )
            return False
        exc = self.compiled.exception()
        if exc is not None:
            self.error = f"{GRAMMAR_ERROR_PREFIX} the grammar failed to compile: {clean_error(exc)}"
            return False
        # Without EOS ids the grammar ends the sequence itself as soon as it is complete.
        self.matcher = xgrammar.GrammarMatcher(
            self.compiled.result(),
            override_stop_tokens=self.stop_token_ids or None,
            terminate_without_stop_token=not self.stop_token_ids,
        )
        return True

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        assert self.matcher is not None, "accept() before the grammar was ready"
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and has taken its stop token: the sequence must end."""
        return self.matcher is not None and self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        assert self.matcher is not None, "fill_bitmask() before the grammar was ready"
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_draft_bitmasks(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> None:
        """Speculative decoding: rows `first_row + j` get the mask after `drafts[:j]`, for j in
        0..len(drafts); the matcher then rolls back to where it was.

        The scheduler accepts the tokens that verification keeps, in order, afterwards. A draft
        the grammar refuses ends the filling: its own row's mask already rules it out, so no
        row after it can be reached (those stay all-allowed).
        """
        matcher = self.matcher
        assert matcher is not None, "fill_draft_bitmasks() before the grammar was ready"
        advanced = 0
        for j in range(len(drafts) + 1):
            if j:
                if matcher.is_terminated() or not matcher.accept_token(drafts[j - 1]):
                    break
                advanced += 1
                if matcher.is_terminated():  # the draft ended the output: nothing follows
                    break
            matcher.fill_next_token_bitmask(bitmask, first_row + j)
        if advanced:
            matcher.rollback(advanced)
