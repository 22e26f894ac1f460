"""Speculative decoding's settings (`speculative_config`, vLLM's names and JSON form).

Apart from `config.py` (which re-exports these names) because the methods' settings and their
checks are most of a config module on their own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tokenwise.config_checks import check_int as _check_int

SPEC_METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3", "mtp")
# Methods whose proposer is a model of its own (a checkpoint directory in `model`; for "mtp"
# the target's own checkpoint unless `model` names another).
SPEC_MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
# Where speculation stops paying on CPU (benchmarks/spec_decode.py, Llama ~100M shape, bf16,
# k=4): at 98% acceptance it still gave 1.84x at 32 streams, down from 2.9x at one; at a more
# usual ~50-60% acceptance that extrapolates to about break-even at 32 streams.
DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE = 32


@dataclass
class SpeculativeConfig:
    """Speculative decoding (`speculative_config`, vLLM's names and JSON form).

    `method` "ngram" proposes up to `num_speculative_tokens` drafts by prompt lookup: the
    tokens that followed the most recent earlier occurrence of the sequence's last
    `prompt_lookup_min`..`prompt_lookup_max` tokens. `model` (a checkpoint directory; method
    "draft_model", implied by `model`) has a smaller model with the target's vocabulary
    propose them greedily (`tokenwise.spec_decode.draft_model`). "eagle" and "eagle3" have an
    EAGLE head (`model`: its checkpoint directory, in the published layouts) propose them from
    the target's own hidden states (`tokenwise.spec_decode.eagle`). No proposal is made while
    `disable_by_batch_size` or more requests are running (verification then costs more than
    it saves). "mtp" runs DeepSeek-V3's multi-token-prediction module, kept in the target's
    checkpoint, the same way (`tokenwise.models.deepseek_mtp`). "suffix" is suffix decoding
    (`tokenwise.spec_decode.suffix`): a frequency-counted suffix tree over each request's
    prompt and output and over the outputs of the last `suffix_decoding_max_cached_requests`
    requests, proposing a variable number of drafts per step (at most
    `num_speculative_tokens`, which defaults to `suffix_decoding_max_tree_depth` as in vLLM).
    """

    num_speculative_tokens: int | None = None
    method: str | None = None
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE
    # Suffix decoding (method "suffix"; vLLM's names and defaults).
    suffix_decoding_max_tree_depth: int = 24
    # vLLM's default is 10000; its trees are C++. Ours are Python, ~7 KB per cached token at
    # depth 24, so 10000 outputs of 500 tokens would hold ~35 GB: 100 holds ~350 MB at most.
    suffix_decoding_max_cached_requests: int = 100
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method == "suffix":
            self._check_suffix()
        else:
            self._refuse_suffix_fields()
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        _check_int("speculative_config.num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "ngram"
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPEC_METHODS)}, "
                f"got {self.method!r}"
            )
        if self.method in SPEC_MODEL_METHODS:
            self._check_draft_model()
        elif self.model is not None:
            raise ValueError(
                "speculative_config.model applies to methods "
                f"{', '.join(SPEC_MODEL_METHODS)}, not {self.method!r}"
            )
        if self.method == "ngram":
            if self.prompt_lookup_min is None:
                self.prompt_lookup_min = 1
            if self.prompt_lookup_max is None:
                self.prompt_lookup_max = max(5, self.prompt_lookup_min)
            _check_int("speculative_config.prompt_lookup_min", self.prompt_lookup_min, 1)
            _check_int("speculative_config.prompt_lookup_max", self.prompt_lookup_max, 1)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(
                    "speculative_config.prompt_lookup_min must be <= prompt_lookup_max, got "
                    f"{self.prompt_lookup_min} > {self.prompt_lookup_max}"
                )
        if self.disable_by_batch_size is not None:
            _check_int("speculative_config.disable_by_batch_size", self.disable_by_batch_size, 1)

    def _check_suffix(self) -> None:
        """Suffix decoding's settings in range; `num_speculative_tokens` defaults to the tree
        depth (a draft never runs deeper than the tree)."""
        prefix = "speculative_config.suffix_decoding_"
        _check_int(prefix + "max_tree_depth", self.suffix_decoding_max_tree_depth, 2)
        _check_int(prefix + "max_cached_requests", self.suffix_decoding_max_cached_requests, 0)
        factor = self.suffix_decoding_max_spec_factor
        if not _is_number(factor) or factor <= 0:
            raise ValueError(f"{prefix}max_spec_factor must be a number > 0, got {factor!r}")
        prob = self.suffix_decoding_min_token_prob
        if not _is_number(prob) or not 0 <= prob <= 1:
            raise ValueError(f"{prefix}min_token_prob must be a number in [0, 1], got {prob!r}")
        if self.model is not None:
            raise ValueError("speculative_config.model does not apply to method 'suffix'")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"speculative_config.{name} applies to method 'ngram', not 'suffix'"
                )
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = self.suffix_decoding_max_tree_depth

    def _refuse_suffix_fields(self) -> None:
        """A `suffix_decoding_*` key set for another method is a mistake worth naming."""
        for name in _SUFFIX_FIELDS:
            if getattr(self, name) != _SUFFIX_DEFAULTS[name]:
                raise ValueError(
                    f"speculative_config.{name} applies to method 'suffix', not "
                    f"{self.method or 'ngram'!r}"
                )

    def _check_draft_model(self) -> None:
        """A draft model or EAGLE head needs its checkpoint directory; prompt lookup settings
        are n-gram's.

        The draft's vocabulary (and an EAGLE head's hidden size) is checked against the
        target's when the engine loads it: only then are both configs read."""
        if self.model is None and self.method == "mtp":
            pass  # the MTP module is in the target's checkpoint
        elif self.model is None:
            what = "draft" if self.method == "draft_model" else "EAGLE head's"
            raise ValueError(
                f"speculative_config.model is required for method {self.method!r} (the {what} "
                "checkpoint directory)"
            )
        elif not isinstance(self.model, str) or not os.path.isdir(self.model):
            raise ValueError(
                f"speculative_config.model must be a checkpoint directory; {self.model!r} is not "
                "a directory"
            )
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"speculative_config.{name} applies to method 'ngram', not {self.method!r}"
                )

    @classmethod
    def from_dict(cls, fields: Any) -> SpeculativeConfig:
        """From the JSON object users write; unknown keys are errors naming them."""
        if isinstance(fields, SpeculativeConfig):
            return fields
        if not isinstance(fields, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {fields!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown field(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        return cls(**fields)


_SUFFIX_FIELDS = tuple(f for f in SpeculativeConfig.__dataclass_fields__ if f.startswith("suffix_"))
_SUFFIX_DEFAULTS = {f: SpeculativeConfig.__dataclass_fields__[f].default for f in _SUFFIX_FIELDS}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
