"""What the engine reports, kept apart from what it schedules: one output processor.

The scheduler's `Request` holds scheduling state only (tokens, progress, status, its grammar,
its place). Everything that exists to be reported lives here, per sample (`SampleOutput`): the
incremental detokenizer (whose stop strings feed the stop rules), the tokens and logprob
entries kept since the last output, the cumulative logprob, the prompt-token logprobs, the time
of the first token, and whether the finished output was made. The processor also keeps the
caller's requests (the caller's id -> its samples, `n` of them) until their finished output is
made; the engine asks it what changed in a step and the model kind turns that into outputs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tokenwise.engine.detokenizer import IncrementalDetokenizer
from tokenwise.engine.request import Request
from tokenwise.engine.stats import EngineStats
from tokenwise.engine.step_outputs import ModelRunnerOutput, ScoredPromptTokens
from tokenwise.engine.stop_rules import hides_token
from tokenwise.outputs import Logprob

# What a step changed: the caller's request id -> its samples.
Touched = dict[str, list[Request]]


@dataclass(eq=False)
class SampleOutput:
    """One sample's output state: what it reports, and what it has reported."""

    index: int = 0  # among the samples of an `n > 1` request
    prompt: str | None = None  # the prompt's text, if it had one
    detokenizer: IncrementalDetokenizer | None = None
    # Tokens and logprob entries sampled since the last output was made.
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    first_token_time: float | None = None
    reported_finish: bool = False  # its finished output was made: it is gone from the engine
    # `SamplingParams.prompt_logprobs`: one entry per prompt token scored so far (the first is
    # None: nothing comes before it); None when not asked for.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_reported: bool = False  # the request's output carried them once


class OutputProcessor:
    """The caller's requests and each sample's output state, from acceptance to last output."""

    def __init__(self, tokenizer: Any, stats: EngineStats) -> None:
        self.tokenizer = tokenizer
        self.stats = stats
        self.groups: dict[str, list[Request]] = {}
        self._outputs: dict[str, SampleOutput] = {}  # by sample (`Request.request_id`)

    def add(self, request_id: str, samples: list[tuple[Request, SampleOutput]]) -> None:
        self.groups[request_id] = [req for req, _ in samples]
        for req, out in samples:
            if req.sampling_params.prompt_logprobs is not None and out.prompt_logprobs is None:
                out.prompt_logprobs = [None]
            self._outputs[req.request_id] = out

    def of(self, req: Request) -> SampleOutput:
        return self._outputs[req.request_id]

    def outputs_of(self, samples: list[Request]) -> list[SampleOutput]:
        return [self._outputs[req.request_id] for req in samples]

    def touch(self, req: Request, touched: Touched) -> None:
        """Have the step report `req`'s request."""
        touched[req.group_id] = self.groups[req.group_id]

    def forget(self, request_id: str) -> None:
        """The request's finished output was made: it leaves the engine."""
        for req in self.groups.pop(request_id):
            del self._outputs[req.request_id]

    def unreported_finished(self) -> Iterator[tuple[str, list[Request]]]:
        """Requests with a sample that finished (aborted, errored) and was not reported yet."""
        for rid, samples in self.groups.items():
            if any(
                r.is_finished and not self._outputs[r.request_id].reported_finish for r in samples
            ):
                yield rid, samples

    # ---- one step ---------------------------------------------------------------------------

    def detokenize_token(self, req: Request, token: int) -> str | None:
        """Feed one sampled token to its sample's detokenizer, before the scheduler appends it.

        Returns the stop string the token completed, if any, for the scheduler's stop rules.
        As in vLLM, a stop token ends the text without appearing in it, so such a token is not
        detokenized (`stop_rules.hides_token`).
        """
        detokenizer = self._outputs[req.request_id].detokenizer
        if detokenizer is None or hides_token(req, token):
            return None
        return detokenizer.add_token(token)

    def record_samples(
        self, sampled: list[tuple[Request, int]], result: ModelRunnerOutput, touched: Touched
    ) -> None:
        """Record each kept token (and its logprobs) on its sample, for the next output.

        `sampled` pairs each request with how many of its emitted tokens it kept (a stop cuts
        the rest); logprob rows follow the emitted tokens, request after request.
        """
        now = time.monotonic()
        lp = result.logprobs
        lp_ids = lp.token_ids.tolist() if lp is not None else None
        lp_vals = lp.logprobs.tolist() if lp is not None else None
        lp_ranks = lp.ranks.tolist() if lp is not None else None
        row = 0
        for (req, kept), tokens in zip(sampled, result.sampled_token_ids, strict=True):
            if not kept:  # async scheduling: a step sampled for a request already finished
                row += len(tokens)
                continue
            touched[req.group_id] = self.groups[req.group_id]
            out = self._outputs[req.request_id]
            if out.first_token_time is None:
                out.first_token_time = now
            num_logprobs = req.sampling_params.logprobs
            for offset, token in enumerate(tokens[:kept]):
                out.new_token_ids.append(token)
                if num_logprobs is not None and lp_ids is not None:
                    r = row + offset
                    entry = logprob_entry(
                        token, num_logprobs, lp_ids[r], lp_vals[r], self.tokenizer
                    )
                    entry[token].rank = lp_ranks[r]
                    out.new_logprobs.append(entry)
                    out.cumulative_logprob += lp_vals[r][0]
            self.stats.generation_tokens_total += kept
            row += len(tokens)

    def record_prompt_logprobs(self, scored: ScoredPromptTokens) -> None:
        """Append a step's prompt-token logprobs to their samples' lists, in prompt order.

        Only a token right after a list's end is taken, so a prompt scored again (it cannot
        be: the runner scores only past what it scored) would still not be reported twice.
        """
        lp = scored.logprobs
        ids, values, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
        row = 0
        for req, first, count in scored.requests:
            out = self._outputs.get(req.request_id)  # None: it finished while the step ran
            entries = out.prompt_logprobs if out is not None else None
            num = req.sampling_params.prompt_logprobs or 0
            for k in range(count):
                if entries is not None and first + k == len(entries):
                    token = req.prompt_token_ids[first + k]
                    entry = logprob_entry(token, num, ids[row + k], values[row + k], self.tokenizer)
                    entry[token].rank = ranks[row + k]
                    entries.append(entry)
            row += count


def logprob_entry(
    token: int, num: int, ids: list[int], values: list[float], tokenizer: Any
) -> dict[int, Logprob]:
    """The sampled token (column 0) plus the top-`num` tokens, decoded when possible."""
    entry = {token: Logprob(values[0])}
    for j in range(1, num + 1):
        entry.setdefault(ids[j], Logprob(values[j], j))
    if tokenizer is not None:
        for tid, value in entry.items():
            value.decoded_token = tokenizer.decode([tid])
    return entry
