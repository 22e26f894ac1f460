"""The scheduler's per-token bookkeeping around a forward pass: drafts in, tokens and stops out.

Apart from `scheduler.py` because it is request arithmetic with no placement in it (no queue,
no block, no budget beyond the one number passed in): which proposed drafts a decode step
verifies, and, after the pass, each request's computed tokens (rejected drafts rolled back),
its sampled tokens appended and the stop rules applied. The scheduler calls both and stays
the one writer of request state; it then frees what finished.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenwise.engine.request import Request, RequestStatus
from tokenwise.engine.step_outputs import ModelRunnerOutput, SchedulerOutput
from tokenwise.engine.stop_rules import check_stop

# What the engine hears of each accepted token: (request, token) -> a matched stop string or
# None (the output processor's incremental detokenizer checks them).
OnToken = Callable[[Request, int], str | None]


def drafts_to_verify(req: Request, num_new: int, budget: int, max_model_len: int) -> list[int]:
    """The drafts `req` verifies this step: its proposed ones, cut to what fits.

    Only a decode step (one new token) carries drafts. They must fit the step's token
    budget and the model length, and no more tokens may be emitted than `max_tokens`
    allows (the drafts plus one drawn token). The request's proposal is consumed either way.
    """
    spec = req.spec_token_ids
    if not spec:  # every step of every request without drafts: no allocation here
        return []
    req.spec_token_ids = []
    if num_new != 1:
        return []
    room = min(budget - 1, max_model_len - req.num_tokens)
    max_tokens = req.sampling_params.max_tokens
    if max_tokens is not None:
        room = min(room, max_tokens - req.num_output_tokens - 1)
    return spec[: max(room, 0)]


def apply_forward_pass(
    scheduler_output: SchedulerOutput,
    runner_output: ModelRunnerOutput,
    on_token: OnToken | None,
    max_model_len: int,
    scheduled_ahead: bool = False,
) -> tuple[list[tuple[Request, int]], dict[RequestStatus, list[Request]]]:
    """Computed tokens, sampled tokens and stops of one pass, applied to its requests.

    Returns each request that received tokens with how many it kept (in the runner's sampling
    order), and the requests that finished, by status, for the scheduler to free. A stop ends
    a request at the token that completed it, so drafts accepted after that token are dropped;
    rejected drafts roll back here (the request's computed tokens count only its accepted
    drafts, so the next step overwrites the K/V the rejected ones left in the cache).

    `scheduled_ahead` (async scheduling, `async_scheduler.py`): computed tokens were counted
    when the step was scheduled, each emitted token fills one of the request's placeholders,
    and a request that finished while the step ran keeps nothing (kept 0: its token is
    discarded; a preempted one keeps its token, which it recomputes with the rest).
    """
    if not scheduled_ahead:
        for item in scheduler_output.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
    sampled: list[tuple[Request, int]] = []
    finished: dict[RequestStatus, list[Request]] = {}
    for item, tokens in zip(
        runner_output.sampled_requests, runner_output.sampled_token_ids, strict=True
    ):
        req = item.request
        if scheduled_ahead:
            req.num_output_placeholders = max(0, req.num_output_placeholders - len(tokens))
            if req.is_finished:
                sampled.append((req, 0))
                continue
        if item.spec_token_ids:  # the drafts after the first rejected one were not kept
            req.num_computed_tokens -= len(item.spec_token_ids) - (len(tokens) - 1)
        kept = 0
        for token in tokens:
            stop_str = on_token(req, token) if on_token is not None else None
            req.append_output_token(token)
            kept += 1
            status = check_stop(req, token, stop_str, max_model_len)
            if status is not None:
                finished.setdefault(status, []).append(req)
                break
        sampled.append((req, kept))
    # A pooled request (an embedding) is complete once its step ran.
    pooled = [item.request for item in runner_output.pooled_requests]
    if pooled:
        finished.setdefault(RequestStatus.FINISHED_STOPPED, []).extend(pooled)
    return sampled, finished
