"""The scheduler cannot livelock: whatever the pool and limits, every request ends, in bounded
steps, and leaves every KV block free.

Hypothesis drives the real `Scheduler` and `BlockManager` with random pools (including pools
smaller than one sequence, which the engine itself refuses, so the scheduler's own guard is
what is tested), prompts with shared prefixes, token budgets, chunked prefill on or off,
`max_tokens` and explicit aborts. The model is replaced by "append one token whenever a
sequence's last known token has been computed": scheduling never looks at token values.

Why the bound holds: the oldest running request is never preempted (victims are taken from
the newest end) and gets at least one token of every step's budget, so it finishes within
`max_model_len` steps of becoming the oldest; a step with nothing running either admits a
request (which then is the oldest) or aborts the unplaceable head of the queue. Hence at most
`N * (max_model_len + 1)` steps for N sequences.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenwise.config import SchedulerConfig
from tokenwise.engine.block_manager import BlockManager
from tokenwise.engine.request import Request, RequestStatus
from tokenwise.engine.scheduler import Scheduler
from tokenwise.sampling.params import SamplingParams


@dataclass
class Workload:
    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    enable_caching: bool
    requests: list[tuple[list[int], int]]  # (prompt, max_tokens)
    aborts: dict[int, int]  # step -> index of the request to abort then
    # The scheduling policy, and each request's priority under "priority" (None: all 0).
    policy: str = "fcfs"
    priorities: list[int] | None = None


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.integers(4, 96))
    # From far too small for one sequence to roomy.
    num_blocks = draw(st.integers(1, 2 * (-(-max_model_len // block_size)) + 2))
    shared = draw(st.lists(st.integers(0, 3), min_size=0, max_size=40))
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        prefix = shared[: draw(st.integers(0, len(shared)))]
        tail = draw(st.lists(st.integers(0, 50), min_size=1, max_size=40))
        prompt = (prefix + tail)[: max_model_len - 1]
        requests.append((prompt, draw(st.integers(1, 40))))
    aborts = draw(
        st.dictionaries(st.integers(0, 30), st.integers(0, len(requests) - 1), max_size=2)
    )
    return Workload(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 64)),
        enable_chunked_prefill=draw(st.booleans()),
        enable_caching=draw(st.booleans()),
        requests=requests,
        aborts=aborts,
    )


def _could_never_fit(req: Request, w: Workload) -> bool:
    """Whether `req`, at its current length, exceeds what the pool or one step can ever give."""
    needs_blocks = -(-req.num_tokens // w.block_size)
    too_long_for_a_step = not w.enable_chunked_prefill and req.num_tokens > w.max_num_batched_tokens
    return needs_blocks > w.num_blocks or too_long_for_a_step


def run_workload(w: Workload) -> tuple[list[Request], dict[str, str], BlockManager]:
    """Drive the scheduler to the end; returns (accepted requests, abort reasons, the pool)."""
    bm = BlockManager(w.num_blocks, w.block_size, enable_caching=w.enable_caching)
    config = SchedulerConfig(
        max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=w.max_num_batched_tokens,
        enable_chunked_prefill=w.enable_chunked_prefill,
        policy=w.policy,
    )
    scheduler = Scheduler(config, bm, w.max_model_len)
    accepted: list[Request] = []
    for i, (prompt, max_tokens) in enumerate(w.requests):
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        req.priority = w.priorities[i] if w.priorities else 0
        try:
            scheduler.add_request(req)  # an error at admission is an allowed ending
        except ValueError:
            continue
        accepted.append(req)
    by_index = {int(r.request_id[1:]): r for r in accepted}
    bound = len(accepted) * (w.max_model_len + 1) + 1
    reasons: dict[str, str] = {}
    for step in itertools.count():
        if not scheduler.has_unfinished_requests():
            break
        assert step < bound, f"no progress: still unfinished after {bound} steps"
        if step in w.aborts and w.aborts[step] in by_index:
            scheduler.finish_requests([by_index[w.aborts[step]]], RequestStatus.FINISHED_ABORTED)
        out = scheduler.schedule()
        bm.check_invariants()
        assert out.total_num_tokens <= w.max_num_batched_tokens
        assert len(out.scheduled) <= w.max_num_seqs
        for req, reason in out.aborted:
            assert req.status is RequestStatus.FINISHED_ABORTED
            assert _could_never_fit(req, w), f"{req.request_id} fits but was aborted: {reason}"
            reasons[req.request_id] = reason
        finished = []
        for item in out.scheduled:
            req = item.request
            samples = item.completes_sequence
            req.num_computed_tokens += item.num_new_tokens
            if samples:
                req.append_output_token(7)
                if (
                    req.num_output_tokens >= req.sampling_params.max_tokens
                    or req.num_tokens >= w.max_model_len
                ):
                    finished.append(req)
        scheduler.finish_requests(finished, RequestStatus.FINISHED_LENGTH)
    return accepted, reasons, bm


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workloads())
def test_every_request_ends_and_frees_its_blocks(w: Workload) -> None:
    accepted, reasons, bm = run_workload(w)
    assert all(req.is_finished for req in accepted)
    assert bm.get_num_free_blocks() == w.num_blocks and bm.pool.num_used == 0
    for req in accepted:
        if req.status is RequestStatus.FINISHED_LENGTH:
            assert req.num_output_tokens == min(
                req.sampling_params.max_tokens, w.max_model_len - req.num_prompt_tokens
            )
        if req.request_id in reasons:
            assert (
                "blocks" in reasons[req.request_id]
                or "max_num_batched_tokens" in (reasons[req.request_id])
            )


def _single(
    num_blocks: int, block_size: int, prompt_len: int, max_tokens: int, **limits: int | bool
) -> tuple[Request, dict[str, str]]:
    """One request through a fresh scheduler, which must end with every block free."""
    w = Workload(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=int(limits.pop("max_model_len", 512)),
        max_num_seqs=int(limits.pop("max_num_seqs", 4)),
        max_num_batched_tokens=int(limits.pop("max_num_batched_tokens", 2048)),
        enable_chunked_prefill=bool(limits.pop("enable_chunked_prefill", True)),
        enable_caching=True,
        requests=[(list(range(prompt_len)), max_tokens)],
        aborts={},
    )
    accepted, reasons, bm = run_workload(w)
    assert bm.get_num_free_blocks() == num_blocks
    return accepted[0], reasons


def test_the_reported_livelock_ends_with_abort() -> None:
    """The issue's case: 24 blocks of 4 (96 tokens), a 90-token prompt, 12 new tokens. The
    prompt fits, decoding outgrows the whole pool at token 97: that used to preempt and
    re-admit forever."""
    req, reasons = _single(24, 4, 90, 12)
    assert req.status is RequestStatus.FINISHED_ABORTED
    # Every token whose K/V fits was computed: 96 slots, so 7 sampled tokens (97 in all).
    assert req.num_output_tokens == 7
    assert "needs 25 KV blocks for 97 tokens" in reasons["r0"] and "24 blocks" in reasons["r0"]


def test_prompt_that_outgrows_the_step_budget_after_preemption_is_aborted() -> None:
    """Chunked prefill off: a preempted request must recompute prompt + output in one step;
    once that exceeds max_num_batched_tokens it can never run again."""
    w = Workload(
        num_blocks=10,
        block_size=4,
        max_model_len=40,
        max_num_seqs=4,
        max_num_batched_tokens=12,
        enable_chunked_prefill=False,
        enable_caching=False,
        requests=[(list(range(10)), 30), (list(range(20, 22)), 30)],
        aborts={},
    )
    accepted, reasons, bm = run_workload(w)
    first, second = accepted
    assert first.status is RequestStatus.FINISHED_LENGTH and first.num_tokens == 40
    assert second.status is RequestStatus.FINISHED_ABORTED and second.num_preemptions == 1
    assert "max_num_batched_tokens=12" in reasons["r1"] and second.num_tokens > 12
    assert bm.get_num_free_blocks() == 10


@pytest.mark.parametrize("enable_chunked_prefill", [True, False])
def test_request_that_fits_is_never_aborted(enable_chunked_prefill: bool) -> None:
    req, reasons = _single(
        24, 4, 90, 12, max_model_len=96, enable_chunked_prefill=enable_chunked_prefill
    )
    assert req.status is RequestStatus.FINISHED_LENGTH and not reasons
    assert req.num_output_tokens == 6  # stopped by max_model_len, not by the pool
