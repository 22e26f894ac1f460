"""The per-request draft budget: grows on accepted drafts, shrinks on rejected ones, and turns
drafting off (for a back-off that doubles) when too few are accepted."""

from __future__ import annotations

from tokenwise.spec_decode.draft_budget import (
    BACKOFF_STEPS,
    MAX_BACKOFF_STEPS,
    PROBE_STEPS,
    DraftBudget,
)


def paused_steps(budget: DraftBudget, rid: str) -> int:
    """Steps with a limit of 0 before drafting resumes."""
    steps = 0
    while budget.limit(rid) == 0:
        steps += 1
        assert steps <= MAX_BACKOFF_STEPS
    return steps


def test_the_limit_follows_how_many_drafts_are_accepted() -> None:
    budget = DraftBudget(8)
    assert budget.limit("a") == 8  # a new request may use all k
    budget.observe("a", 8, 3)
    assert budget.limit("a") == 7
    budget.observe("a", 7, 1)
    budget.observe("a", 6, 6)  # all accepted: grows again
    assert budget.limit("a") == 8
    budget.observe("a", 2, 2)  # a short proposal fully accepted does not lower it
    assert budget.limit("a") == 8
    assert budget.limit("b") == 8  # requests are independent


def test_rejected_drafts_turn_drafting_off_for_a_doubling_back_off() -> None:
    budget = DraftBudget(4)
    for _ in range(PROBE_STEPS):
        budget.observe("a", 4, 0)
    assert paused_steps(budget, "a") == BACKOFF_STEPS
    probe = budget.limit("a")
    assert 1 <= probe < 4  # it probes again with a smaller budget
    for _ in range(PROBE_STEPS):
        budget.observe("a", 1, 0)
    assert paused_steps(budget, "a") == 2 * BACKOFF_STEPS


def test_a_probe_that_pays_resets_the_back_off() -> None:
    budget = DraftBudget(4)
    for _ in range(PROBE_STEPS):
        budget.observe("a", 4, 0)
    paused_steps(budget, "a")
    for _ in range(PROBE_STEPS):
        budget.observe("a", 2, 2)
    assert budget.limit("a") == 4
    for _ in range(PROBE_STEPS + 2):  # acceptance falls slowly from a good average
        budget.observe("a", 4, 0)
    assert paused_steps(budget, "a") == BACKOFF_STEPS


def test_partial_acceptance_above_the_threshold_keeps_drafting() -> None:
    budget = DraftBudget(4)
    for _ in range(50):
        limit = budget.limit("a")
        assert limit > 0
        budget.observe("a", limit, (limit + 1) // 2)  # about half of the drafts accepted
