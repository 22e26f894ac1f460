"""Per-request sampling parameters, with vLLM's field names and defaults.

Requests arrive from user code and from the HTTP server, so every field is
validated eagerly: a bad value should fail at submission with a message that
names the parameter, not deep inside a batched kernel several steps later.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass
from typing import Any

from tokenwise.sampling.guided.params import GuidedDecodingParams

# Temperatures below this are treated as greedy: dividing logits by ~0 would
# overflow, and argmax is what such a temperature means anyway.
_SAMPLING_EPS = 1e-5
# What torch.Generator.manual_seed accepts. Sample i of a request with n > 1 is seeded with
# seed + i, so the largest valid seed shrinks by n - 1.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


class SamplingType(enum.IntEnum):
    """How a row picks its token; the sampler batches rows by this."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but `n=True` is almost certainly a bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(
        value
    )


def _require_int(name: str, value: Any) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")


def _require_real(name: str, value: Any) -> None:
    if not _is_real(value):
        raise ValueError(f"{name} must be a finite number, got {value!r} ({type(value).__name__})")


@dataclass
class SamplingParams:
    """What the user asked for; the engine turns a batch of these into tensors.

    ``top_k`` of 0 or -1 and ``top_p`` of 1 mean "off", as in vLLM, so the
    defaults describe plain sampling from the full softmax at temperature 1.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured output: the text must match this JSON schema, regex, choice or grammar.
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        self._normalise()
        self._validate()

    def _normalise(self) -> None:
        # Downstream code can then assume lists and a single "off" value for top_k.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a str or a list of str, got {self.stop!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(f"stop_token_ids must be a list of int, got {self.stop_token_ids!r}")
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        if _is_real(self.temperature):
            self.temperature = float(self.temperature)

    def _validate(self) -> None:
        _require_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        _require_real("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _require_real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _require_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        _require_real("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _require_int("seed", self.seed)
            top = _SEED_MAX - (self.n - 1)
            if not _SEED_MIN <= self.seed <= top:
                raise ValueError(
                    f"seed must be in [{_SEED_MIN}, {top}] (n={self.n}), got {self.seed}"
                )
        self._validate_lengths()
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require_real(name, value)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _require_real("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        self._validate_stops()
        if self.guided_decoding is not None and not isinstance(
            self.guided_decoding, GuidedDecodingParams
        ):
            raise ValueError(
                "guided_decoding must be a GuidedDecodingParams or None, got "
                f"{type(self.guided_decoding).__name__}"
            )

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None:
            _require_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be None or >= 1, got {self.max_tokens}")
        _require_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.logprobs is not None:
            _require_int("logprobs", self.logprobs)
            if self.logprobs < 0:
                raise ValueError(f"logprobs must be None or >= 0, got {self.logprobs}")

    def _validate_stops(self) -> None:
        assert isinstance(self.stop, list) and isinstance(self.stop_token_ids, list)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must contain only non-empty strings, got {self.stop!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must contain only ints >= 0, got {self.stop_token_ids!r}"
            )

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def clone(self) -> SamplingParams:
        """Deep copy, so per-request mutation (e.g. n>1 fan-out) never aliases lists."""
        return copy.deepcopy(self)
