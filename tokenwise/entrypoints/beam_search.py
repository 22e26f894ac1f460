"""Beam search on top of the engine, as vLLM v1 builds it, with Hugging Face's semantics.

The engine knows nothing of beams. Each step, every live beam of every prompt becomes one engine
request for a single token with the top-K logprobs (all in one batch; the prefix cache makes
the beams' shared prefix cheap), and `BeamSearch.advance` expands and prunes them. K is
`max(2, 1 + number of EOS ids) * beam_width` (2 * beam_width with one EOS id, vLLM's count):
the best K continuations over all beams are each within their own beam's top K, so nothing
that could be chosen is missed.

Which beams survive, and when the search ends, follow `transformers`' `generate(num_beams=k,
do_sample=False)` exactly, so the results equal its `num_return_sequences=k` sequences:

- the K best continuations of all beams, by cumulative logprob, are considered; the best
  `beam_width` of them that did not stop (EOS, or `max_tokens` reached) run on;
- a continuation that stopped becomes a finished hypothesis only if it is among the best
  `beam_width` of the K, scored `cum_logprob / generated_len ** length_penalty` (EOS counted);
  the best `beam_width` hypotheses are kept;
- `early_stopping` (HF's): True ends the search once `beam_width` hypotheses exist; False (the
  default) ends it once the best running beam, scored at its current length, cannot beat the
  worst kept hypothesis; "never" does the same but, with `length_penalty > 0`, scores the
  running beam at `max_tokens` (the canonical bound). At `max_tokens` every beam stops.

`temperature` must be 0 (the search is deterministic). The results are the kept hypotheses,
best score first: `tokens` (prompt and output, EOS included), `text` (the output's, without
the EOS unless `include_stop_str_in_output`), `cum_logprob`.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class BeamSearchParams:
    """vLLM's beam-search parameters, plus HF's `early_stopping` (see the module doc)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not _is_number(self.temperature) or self.temperature != 0.0:
            raise ValueError(
                f"temperature must be 0 for beam search (the search is deterministic), "
                f"got {self.temperature!r}"
            )
        if not _is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not (self.early_stopping in (True, False) or self.early_stopping == "never") or (
            self.early_stopping in (0, 1) and not isinstance(self.early_stopping, bool)
        ):
            raise ValueError(
                f"early_stopping must be true, false or 'never', got {self.early_stopping!r}"
            )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class BeamSearchSequence:
    """One beam: prompt and output tokens, the output's logprob sum and (once done) its text."""

    tokens: list[int]
    cum_logprob: float = 0.0
    num_prompt_tokens: int = 0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    score: float | None = None  # cum_logprob / output length ** length_penalty, once finished

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """A prompt's result: its `beam_width` best sequences, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


class BeamSearch:
    """The search for one prompt. `running` are the beams to expand next; `advance` takes, for
    each of them in order, its next token's top-K logprobs (token id -> logprob)."""

    def __init__(
        self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: Sequence[int]
    ) -> None:
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.num_logprobs = max(2, 1 + len(self.eos)) * params.beam_width
        self.num_prompt_tokens = n = len(prompt_token_ids)
        self.running = [BeamSearchSequence(list(prompt_token_ids), 0.0, n)]
        self.finished: list[BeamSearchSequence] = []  # best score first, at most beam_width
        self.num_generated = 0
        self.improvable = True  # whether a running beam may still beat the kept hypotheses
        self.done = False

    def advance(self, next_logprobs: list[dict[int, float]]) -> None:
        p = self.params
        width = p.beam_width
        candidates = [
            (beam.cum_logprob + logprob, b, token)
            for b, (beam, logprobs) in enumerate(zip(self.running, next_logprobs, strict=True))
            for token, logprob in logprobs.items()
        ]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = candidates[: self.num_logprobs]
        length = self.num_generated + 1
        at_max = length >= p.max_tokens
        stops = [at_max or token in self.eos for _, _, token in candidates]

        def extend(cum: float, b: int, token: int) -> BeamSearchSequence:
            beam = self.running[b]
            return BeamSearchSequence([*beam.tokens, token], cum, beam.num_prompt_tokens)

        full = len(self.finished) == width
        if self.improvable and not (full and p.early_stopping is True):
            for cand, stopped in zip(candidates[:width], stops[:width], strict=False):
                if stopped:
                    seq = extend(*cand)
                    seq.score = cand[0] / length**p.length_penalty
                    seq.finish_reason = "stop" if cand[2] in self.eos else "length"
                    self.finished.append(seq)
            # Stable: an earlier hypothesis stays ahead of a new one with an equal score.
            self.finished.sort(key=_score, reverse=True)
            del self.finished[width:]
        self.running = [
            extend(*cand) for cand, stopped in zip(candidates, stops, strict=True) if not stopped
        ][:width]
        self.num_generated = length
        if self.improvable and len(self.finished) == width:
            if not self.running:
                self.improvable = False
            else:
                never = p.early_stopping == "never"
                bound = p.max_tokens if never and p.length_penalty > 0 else length
                best = self.running[0].cum_logprob / bound**p.length_penalty
                self.improvable = best > min(_score(s) for s in self.finished)
        full = len(self.finished) == width
        self.done = not self.improvable or (full and p.early_stopping is True) or all(stops)

    def result(self, decode: Callable[[list[int]], str] | None) -> BeamSearchOutput:
        for seq in self.finished:
            out = seq.output_token_ids
            if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                out = out[:-1]
            seq.text = decode(out) if decode is not None else None
        return BeamSearchOutput(list(self.finished))


def _score(seq: BeamSearchSequence) -> float:
    return seq.score if seq.score is not None else -math.inf


# One engine step for a batch of beams: each beam's tokens in, its next token's top-K logprobs
# out (token id -> logprob), in order.
StepFn = Callable[[list[list[int]], int], list[dict[int, float]]]
AsyncStepFn = Callable[[list[list[int]], int], Awaitable[list[dict[int, float]]]]


def _live(searches: list[BeamSearch]) -> tuple[list[BeamSearch], list[list[int]], int]:
    live = [s for s in searches if not s.done]
    beams = [beam.tokens for s in live for beam in s.running]
    return live, beams, max((s.num_logprobs for s in live), default=0)


def _distribute(live: list[BeamSearch], results: list[dict[int, float]]) -> None:
    start = 0
    for search in live:
        count = len(search.running)
        search.advance(results[start : start + count])
        start += count


def run_beam_search(searches: list[BeamSearch], step: StepFn) -> None:
    """Run every search to its end, all live beams of all of them in each engine step."""
    while True:
        live, beams, k = _live(searches)
        if not live:
            return
        _distribute(live, step(beams, k))


async def run_beam_search_async(searches: list[BeamSearch], step: AsyncStepFn) -> None:
    """`run_beam_search` with an engine step that is awaited (the server's)."""
    while True:
        live, beams, k = _live(searches)
        if not live:
            return
        _distribute(live, await step(beams, k))


def top_logprobs(entry: dict[int, Any] | None, k: int) -> dict[int, float]:
    """token id -> logprob of an engine output's first logprob entry (`Logprob` values), cut
    to its `k` best (the entry also holds the sampled token, one of them under greedy)."""
    if not entry:
        raise RuntimeError("the engine returned no logprobs for a beam")
    items = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]
    return {token: value.logprob for token, value in items}
