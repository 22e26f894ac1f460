"""tokenwise: a readable LLM inference engine.

The heavy entry points (``LLM``, ``SamplingParams``) are imported lazily so that
``import tokenwise.forward_context`` stays cheap and free of model code.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "EngineArgs",
    "SamplingParams",
    "BeamSearchParams",
    "LoRARequest",
    "PoolingParams",
    "PoolerConfig",
    "RequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EmbeddingOutput",
    "ScoringRequestOutput",
    "ScoringOutput",
    "ClassificationRequestOutput",
    "ClassificationOutput",
    "GuidedDecodingParams",
    "__version__",
]


_OUTPUTS = (
    "RequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EmbeddingOutput",
    "ScoringRequestOutput",
    "ScoringOutput",
    "ClassificationRequestOutput",
    "ClassificationOutput",
)


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tokenwise.entrypoints.llm import LLM

        return LLM
    if name == "EngineArgs":
        from tokenwise.entrypoints.engine_args import EngineArgs

        return EngineArgs
    if name == "SamplingParams":
        from tokenwise.sampling.params import SamplingParams

        return SamplingParams
    if name == "BeamSearchParams":
        from tokenwise.entrypoints.beam_search import BeamSearchParams

        return BeamSearchParams
    if name == "LoRARequest":
        from tokenwise.lora.request import LoRARequest

        return LoRARequest
    if name == "PoolingParams":
        from tokenwise.pooling.params import PoolingParams

        return PoolingParams
    if name == "PoolerConfig":
        from tokenwise.config import PoolerConfig

        return PoolerConfig
    if name == "GuidedDecodingParams":
        from tokenwise.sampling.guided.params import GuidedDecodingParams

        return GuidedDecodingParams
    if name in _OUTPUTS:
        from tokenwise import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'tokenwise' has no attribute {name!r}")
