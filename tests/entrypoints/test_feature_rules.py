"""The feature table, walked row by row: each row refuses its combination with its own
message (no earlier row takes it), and a plain text model with default settings passes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tokenwise.config import SpeculativeConfig
from tokenwise.entrypoints.engine_args import EngineArgs
from tokenwise.entrypoints.feature_rules import RULES, Features, check_features


def _features(
    args: dict[str, Any] | None = None,
    task: str = "generate",
    pooling: bool = False,
    quantization: str | None = None,
    device: str = "cpu",
    enforce_eager: bool = True,
    encoder_decoder: bool = False,
    multimodal: bool = False,
    speculative: SpeculativeConfig | None = None,
) -> Features:
    model = SimpleNamespace(
        is_pooling=pooling, task=task, architectures=["ToyForCausalLM"], quantization=quantization
    )
    return Features(
        args=EngineArgs(**(args or {})),
        model=model,
        device=device,
        enforce_eager=enforce_eager,
        encoder_decoder=encoder_decoder,
        multimodal=multimodal,
        speculative=speculative,
    )


EMBED = {"pooling": True, "task": "embed"}
NGRAM = SpeculativeConfig(num_speculative_tokens=2, method="ngram")
MTP = SpeculativeConfig(num_speculative_tokens=1, method="mtp")
ASYNC = {"async_scheduling": True}
# One case per row, in table order: (facts that trigger it, words of its message).
CASES = [
    (_features(quantization="int8", enforce_eager=False), "runs its CPU kernels eagerly"),
    (_features({"kv_cache_dtype": "fp8"}, **EMBED), "task='embed' (pooling) models"),
    (_features({"kv_cache_dtype": "fp8_e5m2"}, encoder_decoder=True), "encoder-decoder"),
    (
        _features({"override_pooler_config": {}}, pooling=True, task="classify"),
        "a classifier pools as it was trained",
    ),
    (_features({"tensor_parallel_size": 2}, **EMBED), "got 1 and 2"),
    (_features({"cudagraph_mode": "FULL"}, **EMBED), "cudagraph_mode must be NONE, got FULL"),
    (_features({"override_pooler_config": {}}), "applies to task='embed' models only"),
    (_features({"data_parallel_size": 2}, encoder_decoder=True), "(BART, Whisper)"),
    (_features({"data_parallel_size": 3}, multimodal=True), "got 3 and 1"),
    (_features(multimodal=True, **EMBED), "task='embed' does not apply"),
    (_features(encoder_decoder=True, speculative=NGRAM), "not to ToyForCausalLM"),
    (_features({"tensor_parallel_size": 2}, speculative=MTP), "tensor_parallel_size=2"),
    (
        _features({"pipeline_parallel_size": 2, "data_parallel_size": 2}),
        "pipeline_parallel_size=2 does not combine with data_parallel_size",
    ),
    (
        _features({"pipeline_parallel_size": 2}, speculative=NGRAM),
        "does not combine with speculative_config",
    ),
    (_features({"pipeline_parallel_size": 3, "enable_lora": True}), "with enable_lora yet"),
    (_features(ASYNC, speculative=NGRAM), "does not run with speculative_config"),
    (_features(ASYNC, **EMBED), "(--async-scheduling) applies to text-only decoder"),
    (_features({**ASYNC, "pipeline_parallel_size": 2}), "pipeline_parallel_size=2"),
    (_features({**ASYNC, "data_parallel_size": 2}), "got 2 and 1"),
    (_features({**ASYNC, "enable_lora": True}), "does not run with enable_lora"),
    (_features({**ASYNC, "kv_offloading_size": 1.0}), "tier loads are not ordered"),
]


def test_every_row_has_a_case() -> None:
    assert len(CASES) == len(RULES)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_row_refuses_its_combination(index: int) -> None:
    features, words = CASES[index]
    refusing = [i for i, rule in enumerate(RULES) if rule.refuses(features)]
    assert refusing[0] == index, (RULES[index].feature, RULES[index].other)
    with pytest.raises(ValueError) as err:
        check_features(features)
    assert words in str(err.value)


def test_what_combines_passes() -> None:
    check_features(_features())
    check_features(_features(ASYNC))
    check_features(_features({"tensor_parallel_size": 2}, speculative=NGRAM))
    check_features(_features({"cudagraph_mode": "NONE"}, **EMBED))
    check_features(_features(quantization="int8", device="cuda", enforce_eager=False))
