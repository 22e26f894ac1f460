"""How many drafts each request verifies next step, driven by how many it has been accepting.

A verifying step costs more than a decode step: each draft is one more query row through every
layer, and on CPU the extra rows are not free (a step verifying 4 drafts took 1.5-2x a decode
step on the built-in model, ~1.1-1.3x on weight-bound models; `benchmarks/spec_decode.py
--costs`). Speculation pays only while enough drafts are accepted to cover that, and which
text a proposer predicts well changes within one request (a function being copied, then new
code). So each request has its own budget:

- the draft limit starts at `START_LIMIT`, doubles after a step whose drafts were all
  accepted (so a long copy reaches k within a few steps) and after one that lost some falls
  to the number accepted plus one, or half its value if that is more (how far ahead the text
  is predictable now; one miss in a long copy does not throw the limit away);
- an exponential average of the fraction of drafts accepted, once it has seen `PROBE_STEPS`
  verifying steps and fallen under `MIN_ACCEPTANCE`, turns drafting off (limit 0) for a
  back-off period that doubles each time the request fails again (up to `MAX_BACKOFF_STEPS`),
  so free text that no proposer predicts runs at plain decoding speed; it is probed again
  with a single draft (the cheapest verifying step), and the back-off resets once a probe
  pays.

A verifying step with many drafts costs most (on the Qwen3-0.6B shape in fp32 on CPU, CPU time
at one thread: 1.05x a decode step with 1 draft and 1.2x with 4-7, replaying CPU graphs; past
7 drafts, eagerly, ~1.3x and more), so the limit only grows on evidence.

Only steps that verified drafts are counted: a proposer that found nothing cost nothing.
"""

from __future__ import annotations

# Fraction of drafts accepted under which speculation is taken to cost more than it saves:
# a draft costs ~0.1-0.25 of a decode step on CPU, so below ~25% accepted it rarely pays.
MIN_ACCEPTANCE = 0.25
ACCEPTANCE_EMA = 0.3  # weight of the newest step in the average
PROBE_STEPS = 3  # verifying steps before the average is trusted
BACKOFF_STEPS = 16  # first pause, in steps; doubled after each failed probe
MAX_BACKOFF_STEPS = 256
START_LIMIT = 4  # drafts a request may verify before it has shown it accepts any


class _Budget:
    __slots__ = ("acceptance", "steps", "skip", "backoff", "limit")

    def __init__(self, k: int) -> None:
        self.acceptance = 1.0
        self.steps = 0
        self.skip = 0
        self.backoff = BACKOFF_STEPS
        self.limit = min(k, START_LIMIT)


class DraftBudget:
    """Per-request draft limits (`limit`) updated from verification results (`observe`)."""

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        self.k = k
        self._budgets: dict[str, _Budget] = {}

    def limit(self, request_id: str) -> int:
        """Drafts the request may verify next step: 0 while it is backing off (each call
        counts one step of the pause down)."""
        budget = self._budgets.get(request_id)
        if budget is None:
            return min(self.k, START_LIMIT)
        if budget.skip > 0:
            budget.skip -= 1
            return 0
        return budget.limit

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """A step verified `proposed` drafts of the request and kept `accepted` of them."""
        if proposed <= 0:
            return
        budget = self._budgets.get(request_id)
        if budget is None:
            budget = self._budgets[request_id] = _Budget(self.k)
        rate = accepted / proposed
        if budget.steps == 0:
            budget.acceptance = rate  # a fresh start carries no earlier evidence
        else:
            budget.acceptance += ACCEPTANCE_EMA * (rate - budget.acceptance)
        budget.steps += 1
        if accepted >= proposed:
            budget.limit = min(self.k, max(budget.limit, 2 * proposed))
        else:
            budget.limit = max(1, accepted + 1, min(budget.limit, proposed) // 2)
        if budget.steps < PROBE_STEPS:
            return
        if budget.acceptance < MIN_ACCEPTANCE:
            budget.skip = budget.backoff
            budget.backoff = min(2 * budget.backoff, MAX_BACKOFF_STEPS)
            budget.steps = 0  # judged afresh when it drafts again
            budget.limit = 1
        else:
            budget.backoff = BACKOFF_STEPS

    def forget(self, alive: set[str]) -> None:
        self._budgets = {rid: b for rid, b in self._budgets.items() if rid in alive}

    def drop(self, request_id: str) -> None:
        self._budgets.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._budgets)


__all__ = ["DraftBudget", "MIN_ACCEPTANCE"]
