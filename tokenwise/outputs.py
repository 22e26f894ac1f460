"""What the engine returns, with vLLM's names: `RequestOutput` holding `CompletionOutput`s, and
for embedding models `EmbeddingRequestOutput` holding an `EmbeddingOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: the token given those before it, plus the top-N (vLLM's shape:
# the first token's entry is None, as nothing comes before it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Engine steps return *deltas* (text and tokens new since the last step); `LLM.generate`
    and the server merge them with `merge()` when they need the whole completion."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # With `SamplingParams.prompt_logprobs`: in the first output that carries a token (the
    # prompt has been scored whole by then), and kept by `merge`.
    prompt_logprobs: PromptLogprobs | None = None
    # Which weights computed it: 0 as loaded, +1 per weight update (`engine/sleep_control.py`).
    weight_version: int = 0

    def merge(self, delta: RequestOutput) -> None:
        """Fold a later delta for the same request into this (cumulative) output."""
        by_index = {o.index: o for o in self.outputs}
        for new in delta.outputs:
            old = by_index.get(new.index)
            if old is None:
                copy = CompletionOutput(
                    new.index,
                    new.text,
                    list(new.token_ids),
                    new.cumulative_logprob,
                    None if new.logprobs is None else list(new.logprobs),
                    new.finish_reason,
                    new.stop_reason,
                )
                self.outputs.append(copy)
                by_index[new.index] = copy
                continue
            old.text += new.text
            old.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                old.logprobs = (old.logprobs or []) + new.logprobs
            old.cumulative_logprob = new.cumulative_logprob
            old.finish_reason = new.finish_reason
            old.stop_reason = new.stop_reason
        self.outputs.sort(key=lambda o: o.index)
        self.finished = delta.finished
        self.num_cached_tokens = delta.num_cached_tokens
        self.error = delta.error or self.error
        self.metrics.update(delta.metrics)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's name): `len(embedding)` is the hidden size."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """The result of one embedding request, returned once, when its single step is done.

    `error` is set (and `outputs.embedding` empty) when the forward pass failed; an aborted
    request finishes with an empty embedding and no error.
    """

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ScoringOutput:
    """The score of one text pair (vLLM's name): a cross-encoder's relevance, in [0, 1] for a
    single-label head (its logit through a sigmoid)."""

    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's result from `LLM.score`; `prompt_token_ids` is the pair as the model read it."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
    error: str | None = None


@dataclass
class ClassificationOutput:
    """One text's class probabilities (vLLM's name), in the order of the model's labels."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """One prompt's result from `LLM.classify`."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
    error: str | None = None
