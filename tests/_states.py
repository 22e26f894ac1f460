"""The runner's state of test requests, for tests that drive the input batch directly.

In the engine the runner builds each state from the `NewRequestData` of the request's first
step and records every token it samples after that; a test that makes `Request`s and
`ScheduledRequest`s by hand gets the same states here, tokens and all.
"""

from __future__ import annotations

import weakref

from tokenwise.engine.request import Request
from tokenwise.engine.step_outputs import NewRequestData, ScheduledRequest
from tokenwise.runner.request_states import CachedRequestState

# One state per request, as the runner keeps one (the input batch holds on to it by row).
_STATES: weakref.WeakKeyDictionary[Request, CachedRequestState] = weakref.WeakKeyDictionary()


def states_of(items: list[ScheduledRequest]) -> dict[str, CachedRequestState]:
    """The states of the entries' requests, by request id, brought up to the requests' tokens
    (what the runner's states hold after recording every sampled token)."""
    states = {}
    for item in items:
        req = item.request
        state = _STATES.get(req)
        if state is None:
            state = _STATES[req] = CachedRequestState.create(NewRequestData.of(req))
        have = state.num_tokens
        state.append(req.all_token_ids[have:])
        states[item.req_id] = state
    return states
