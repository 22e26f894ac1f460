"""Why a sequence ends: every stop rule, in one place, applied once per step.

Three parties need these rules, and before this module each wrote its own copy:

- the runner, before sampling: until a request has `min_tokens` outputs, its stop tokens and
  (unless `ignore_eos`) EOS may not be sampled (`tokens_banned_before_min_tokens`);
- the engine, detokenizing a step's sampled tokens before the scheduler appends them: a stop
  token ends the text without appearing in it, so it is not detokenized (`hides_token`);
- the scheduler, in `update_from_output`, after it appended the step's tokens (`check_stop`):
  grammar completion or rejection, stop tokens, EOS, stop strings, `max_tokens` and
  `max_model_len`, in that order. A stop string is found by the engine's detokenizer and
  handed in; this module never sees text.

So one step runs: sample (banned tokens masked) -> detokenize -> append -> check, once each.
"""

from __future__ import annotations

from typing import Protocol

from tokenwise.engine.request import Request, RequestStatus
from tokenwise.sampling.params import SamplingParams


def may_stop(req: Request) -> bool:
    """Whether a stop token, EOS or stop string may end the request now (`min_tokens` met)."""
    return req.num_output_tokens >= req.sampling_params.min_tokens


class SamplesOutputs(Protocol):
    """What the `min_tokens` ban reads: a `Request`, or the runner's state of one."""

    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]

    @property
    def num_output_tokens(self) -> int: ...


def tokens_banned_before_min_tokens(req: SamplesOutputs) -> list[int]:
    """Tokens the next sample must not be: the stop tokens, and EOS unless `ignore_eos`.

    Empty once the request has `min_tokens` outputs (the next token would be the
    `num_output_tokens + 1`-th, which may stop it then).
    """
    params = req.sampling_params
    if req.num_output_tokens >= params.min_tokens:
        return []
    banned = list(params.stop_token_ids or ())
    if not params.ignore_eos:
        banned.extend(req.eos_token_ids)
    return banned


def hides_token(req: Request, token: int) -> bool:
    """True for a stop token or EOS that will end the request: it is left out of the text (as
    vLLM does), unless `include_stop_str_in_output`. (EOS matters with
    `skip_special_tokens=False`, which a tool-call parser whose markers are special tokens
    asks for: its text would otherwise end in `</s>`.)

    `token` is this step's sample for `req`, not yet appended: it will be output number
    `num_output_tokens + 1`, which is what `min_tokens` is compared with.
    """
    params = req.sampling_params
    ends = token in (params.stop_token_ids or ()) or (
        not params.ignore_eos and token in req.eos_token_ids
    )
    return (
        ends
        and req.num_output_tokens + 1 >= params.min_tokens
        and not params.include_stop_str_in_output
    )


def check_stop(
    req: Request, token: int, stop_str: str | None, max_model_len: int
) -> RequestStatus | None:
    """The status `token` (just appended) ends the request with, or None if it goes on.

    Sets `req.stop_reason` (the stop token or string) or `req.error` (a token its grammar
    rejects) as a side effect. A stop string reached on the last allowed token still reports
    "stop", not "length": stops are checked before the length limits.
    """
    params = req.sampling_params
    grammar = req.grammar
    if grammar is not None:
        if not grammar.accept(token):
            # Only a row with nothing allowed (min_tokens banning the grammar's only choice,
            # EOS) samples outside its mask; the sequence cannot go on.
            req.error = f"guided_decoding: token {token} is not allowed by the grammar"
            return RequestStatus.FINISHED_ERROR
        if grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED  # the output is complete; nothing may follow
    if may_stop(req):
        if token in (params.stop_token_ids or ()):
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if stop_str is not None:
            req.stop_reason = stop_str
            return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
