"""The per-request draft budget: grows on accepted drafts, shrinks on rejected ones, and turns
drafting off (for a back-off that doubles) when too few are accepted."""

from __future__ import annotations

from tokenwise.spec_decode.draft_budget import (
    BACKOFF_STEPS,
    MAX_BACKOFF_STEPS,
    PROBE_STEPS,
    START_LIMIT,
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
    budget = DraftBudget(16)
    assert budget.limit("a") == START_LIMIT  # a new request starts small
    assert DraftBudget(2).limit("a") == 2  # never above k
    budget.observe("a", 4, 4)
    assert budget.limit("a") == 8  # all accepted: doubles
    budget.observe("a", 8, 8)
    budget.observe("a", 16, 16)
    assert budget.limit("a") == 16  # capped at k
    budget.observe("a", 16, 11)  # one miss late in a long copy: accepted + 1
    assert budget.limit("a") == 12
    budget.observe("a", 12, 0)  # a miss at once: half
    assert budget.limit("a") == 6
    budget.observe("a", 2, 2)  # a short proposal, all accepted, does not lower it
    assert budget.limit("a") == 6
    budget.observe("a", 6, 1)
    assert budget.limit("a") == 3
    assert budget.limit("b") == START_LIMIT  # requests are independent


def test_rejected_drafts_turn_drafting_off_for_a_doubling_back_off() -> None:
    budget = DraftBudget(4)
    for _ in range(PROBE_STEPS):
        budget.observe("a", 4, 0)
    assert paused_steps(budget, "a") == BACKOFF_STEPS
    assert budget.limit("a") == 1  # it probes again with one draft
    for _ in range(PROBE_STEPS):
        budget.observe("a", 1, 0)
    assert paused_steps(budget, "a") == 2 * BACKOFF_STEPS


def test_a_probe_that_pays_resets_the_back_off() -> None:
    budget = DraftBudget(4)
    for _ in range(PROBE_STEPS):
        budget.observe("a", 4, 0)
    paused_steps(budget, "a")
    for _ in range(PROBE_STEPS):
        limit = budget.limit("a")
        budget.observe("a", limit, limit)
    assert budget.limit("a") == 4  # 1 -> 2 -> 4 (k)
    for _ in range(PROBE_STEPS + 2):  # acceptance falls slowly from a good average
        budget.observe("a", 4, 0)
    assert paused_steps(budget, "a") == BACKOFF_STEPS


def test_partial_acceptance_above_the_threshold_keeps_drafting() -> None:
    budget = DraftBudget(4)
    for _ in range(50):
        limit = budget.limit("a")
        assert limit > 0
        budget.observe("a", limit, (limit + 1) // 2)  # about half of the drafts accepted
