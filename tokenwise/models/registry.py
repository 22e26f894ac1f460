"""Which tokenwise class serves which Hugging Face `architectures` entry."""

from __future__ import annotations

from torch import nn

from tokenwise.models.llama import LlamaForCausalLM
from tokenwise.models.mistral import MistralForCausalLM
from tokenwise.models.qwen2 import Qwen2ForCausalLM
from tokenwise.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def resolve_model_class(architectures: list[str]) -> type[nn.Module]:
    """The class for the first listed architecture that tokenwise implements."""
    for arch in architectures or []:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture(s) {list(architectures or [])}; "
        f"tokenwise supports: {', '.join(supported_architectures())}"
    )
