"""Per-request sampling parameters, with vLLM's field names and defaults.

Requests arrive from user code and from the HTTP server, so every field is
validated eagerly: a bad value should fail at submission with a message that
names the parameter, not deep inside a batched kernel several steps later.
"""

from __future__ import annotations

import copy
import enum
import math
import re
from dataclasses import dataclass, field
from typing import Any

from tokenwise.sampling.guided.params import GuidedDecodingParams

# Temperatures below this are treated as greedy: dividing logits by ~0 would
# overflow, and argmax is what such a temperature means anyway.
_SAMPLING_EPS = 1e-5
# A logit_bias key that int() reads (Unicode decimal digits, as int() takes them).
_INT_TEXT = re.compile(r"\s*-?\d+\s*")
# OpenAI's range for a logit bias.
_MAX_LOGIT_BIAS = 100.0
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


def _token_key(key: Any) -> Any:
    """A logit_bias key as a token id: JSON object keys are strings ("50256")."""
    if isinstance(key, str) and _INT_TEXT.fullmatch(key):
        return int(key)
    return key


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
    # Logprobs of each prompt token given the tokens before it (`RequestOutput.prompt_logprobs`):
    # the token's own plus the top-N. A request asking for them is prefilled whole, without
    # the prefix cache (see `Scheduler.schedule`): a cached block has no hidden states.
    prompt_logprobs: int | None = None
    # Per-request logits processors (`logits_processors.py`), applied before sampling, so the
    # returned logprobs describe the processed distribution, as with min_tokens and grammars.
    # token id -> bias in [-100, 100] added to its logit (OpenAI's logit_bias; string keys of
    # JSON bodies are taken as ids).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled (vLLM).
    allowed_token_ids: list[int] | None = None
    # Words the output may not contain (vLLM): a word of one token is banned outright, a longer
    # one at its last token when the output so far ends with the rest of it. Tokenized by the
    # engine (`resolve_bad_words`), as written and after a space.
    bad_words: list[str] | None = None
    # Keep only the last N prompt tokens (-1: as many as the model takes, max_model_len - 1).
    truncate_prompt_tokens: int | None = None
    # vLLM's V1 engine has no best-of-n: like it, anything but None or n is refused.
    best_of: int | None = None
    _bad_words_token_ids: list[list[int]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

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
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        elif isinstance(self.bad_words, tuple):
            self.bad_words = list(self.bad_words)
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}

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
        self._validate_processors()
        if self.best_of is not None:
            _require_int("best_of", self.best_of)
            if self.best_of != self.n:
                raise ValueError(
                    f"best_of must be None or equal to n ({self.n}), got {self.best_of}: "
                    "returning the best n of more samples is not supported (as in vLLM V1)"
                )
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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require_int(name, value)
                if value < 0:
                    raise ValueError(f"{name} must be None or >= 0, got {value}")
        if self.truncate_prompt_tokens is not None:
            _require_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ValueError(
                    "truncate_prompt_tokens must be None, -1 or >= 1, got "
                    f"{self.truncate_prompt_tokens}"
                )

    def _validate_stops(self) -> None:
        assert isinstance(self.stop, list) and isinstance(self.stop_token_ids, list)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must contain only non-empty strings, got {self.stop!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must contain only ints >= 0, got {self.stop_token_ids!r}"
            )

    def _validate_processors(self) -> None:
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
            for token, value in bias.items():
                if not (_is_int(token) and token >= 0):
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
                if not (_is_real(value) and -_MAX_LOGIT_BIAS <= value <= _MAX_LOGIT_BIAS):
                    raise ValueError(
                        f"logit_bias values must be in [-100, 100], got {value!r} for token {token}"
                    )
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, list)
            or not allowed
            or not all(_is_int(t) and t >= 0 for t in allowed)
        ):
            raise ValueError(
                f"allowed_token_ids must be a non-empty list of token ids >= 0, got {allowed!r}"
            )
        words = self.bad_words
        if words is not None and (
            not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words)
        ):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {words!r}")

    @property
    def has_logits_processors(self) -> bool:
        """Whether a logits processor of `logits_processors.py` applies to this request."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    def resolve_bad_words(self, tokenizer: Any) -> None:
        """Tokenize `bad_words` for the logits processor: each word as written and after a
        space (a word mid-text is its own tokens; BPE vocabularies fold the space in), left
        stripped, without special tokens, each distinct sequence once."""
        sequences: list[list[int]] = []
        for word in self.bad_words or []:
            stripped = word.lstrip()
            for text in (stripped, " " + stripped):
                ids = list(tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in sequences:
                    sequences.append(ids)
        self._bad_words_token_ids = sequences

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """The token sequences `bad_words` bans (`resolve_bad_words` must have run)."""
        if self.bad_words and self._bad_words_token_ids is None:
            raise RuntimeError("bad_words were not tokenized: call resolve_bad_words(tokenizer)")
        return self._bad_words_token_ids or []

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
