"""The runner's state of test requests, for tests that drive the input batch directly.

In the engine the runner builds each state from the `NewRequestData` of the request's first
step and records every token it samples after that; a test that makes `Request`s and
`ScheduledRequest`s by hand gets the same states here, tokens and all.
"""

from __future__ import annotations

from tokenwise.engine.step_outputs import NewRequestData, ScheduledRequest
from tokenwise.runner.request_states import CachedRequestState


def states_of(items: list[ScheduledRequest]) -> list[CachedRequestState]:
    states = []
    for item in items:
        req = item.request
        state = CachedRequestState.create(NewRequestData.of(req))
        state.append(req.all_token_ids[req.num_prompt_tokens :])
        states.append(state)
    return states
