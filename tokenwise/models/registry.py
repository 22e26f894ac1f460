"""Which tokenwise class serves which Hugging Face `architectures` entry.

Out-of-tree models register themselves by adding to `MODEL_REGISTRY` when their module is
imported. Name such modules in `TOKENWISE_PLUGINS` (comma-separated import paths) so that every
process of an engine imports them, not only the caller's: spawned tensor-parallel workers,
pipeline stages and engine cores inherit the variable and load the plugins when an
architecture is not found (`load_plugins`), as vLLM's plugins do.
"""

from __future__ import annotations

import importlib

from torch import nn

from tokenwise import envs
from tokenwise.config import PoolerConfig
from tokenwise.models.bart import BartForConditionalGeneration
from tokenwise.models.bert import BertEmbeddingModel, XLMRobertaEmbeddingModel
from tokenwise.models.cross_encoder import (
    BertForSequenceClassification,
    XLMRobertaForSequenceClassification,
)
from tokenwise.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from tokenwise.models.gemma2 import Gemma2ForCausalLM
from tokenwise.models.gemma3 import Gemma3ForCausalLM
from tokenwise.models.gemma3_vl import Gemma3ForConditionalGeneration
from tokenwise.models.gemma4 import Gemma4ForCausalLM
from tokenwise.models.gemma4_vl import Gemma4ForConditionalGeneration
from tokenwise.models.gpt_oss import GptOssForCausalLM
from tokenwise.models.image_merge import serves_text_only
from tokenwise.models.llama import LlamaForCausalLM
from tokenwise.models.llava import LlavaForConditionalGeneration
from tokenwise.models.mistral import MistralForCausalLM
from tokenwise.models.mixtral import MixtralForCausalLM
from tokenwise.models.qwen2 import Qwen2ForCausalLM
from tokenwise.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from tokenwise.models.qwen2_moe import Qwen2MoeForCausalLM
from tokenwise.models.qwen3 import Qwen3ForCausalLM, Qwen3ForSequenceClassification
from tokenwise.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from tokenwise.models.qwen3_5_vl import (
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
)
from tokenwise.models.qwen3_moe import Qwen3MoeForCausalLM
from tokenwise.models.qwen3_next import Qwen3NextForCausalLM
from tokenwise.models.whisper import WhisperForConditionalGeneration

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    # Text only: the vision and audio towers' weights are skipped (tokenwise.models.gemma4).
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,
    # Encoder-only embedding models (task "embed"): class attribute `is_pooling_model`.
    "BertModel": BertEmbeddingModel,
    "BertForMaskedLM": BertEmbeddingModel,
    "RobertaModel": XLMRobertaEmbeddingModel,
    "XLMRobertaModel": XLMRobertaEmbeddingModel,
    "XLMRobertaForMaskedLM": XLMRobertaEmbeddingModel,
    # Sequence classifiers (tasks "score" and "classify"): also `is_classifier`.
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    "RobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
    # Encoder-decoder models (task "generate"): class attribute `is_encoder_decoder`.
    "BartForConditionalGeneration": BartForConditionalGeneration,
    "WhisperForConditionalGeneration": WhisperForConditionalGeneration,
    # Vision-language models (task "generate"): class attribute `is_multimodal`.
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    # Decoders (task "generate").
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    # Gated DeltaNet hybrids (recurrent state); the vision-language checkpoints as text models.
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


ENV_PLUGINS = "TOKENWISE_PLUGINS"


def load_plugins() -> list[str]:
    """Import the modules `TOKENWISE_PLUGINS` names (they register their models); the names.

    A module that cannot be imported is an error naming it and the variable.
    """
    names = [n.strip() for n in envs.get(ENV_PLUGINS).split(",") if n.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise ValueError(
                f"{ENV_PLUGINS} names module {name!r}, which cannot be imported: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    return names


def resolve_model_class(architectures: list[str]) -> type[nn.Module]:
    """The class for the first listed architecture that tokenwise (or a plugin) implements."""
    for attempt in range(2):
        for arch in architectures or []:
            if arch in MODEL_REGISTRY:
                return MODEL_REGISTRY[arch]
        if attempt == 0 and not load_plugins():
            break
    raise ValueError(
        f"unsupported model architecture(s) {list(architectures or [])}; "
        f"tokenwise supports: {', '.join(supported_architectures())} (out-of-tree models: "
        f"name their modules in {ENV_PLUGINS})"
    )


def is_moe_architecture(architectures: list[str]) -> bool:
    """Whether the model has MoE layers (class attribute `is_moe`): under data parallelism
    those layers exchange tokens between ranks, so the ranks must step together."""
    try:
        model_cls = resolve_model_class(architectures)
    except ValueError:
        return False
    return bool(getattr(model_cls, "is_moe", False))


def is_pooling_architecture(architectures: list[str]) -> bool:
    """Whether the model is an encoder-only embedding model (it pools, it cannot generate)."""
    try:
        model_cls = resolve_model_class(architectures)
    except ValueError:
        return False
    return bool(getattr(model_cls, "is_pooling_model", False))


def is_classifier_architecture(architectures: list[str]) -> bool:
    """Whether the model ends in a sequence-classification head (it scores and classifies)."""
    try:
        model_cls = resolve_model_class(architectures)
    except ValueError:
        return False
    return bool(getattr(model_cls, "is_classifier", False))


def is_encoder_decoder_architecture(architectures: list[str]) -> bool:
    """Whether the model has an encoder and a cross-attending decoder (BART, Whisper)."""
    try:
        model_cls = resolve_model_class(architectures)
    except ValueError:
        return False
    return bool(getattr(model_cls, "is_encoder_decoder", False))


def is_multimodal_architecture(
    architectures: list[str], limit_mm_per_prompt: dict[str, int] | None = None
) -> bool:
    """Whether the model takes images in its prompts (LLaVA, Qwen2.5-VL); not a checkpoint
    that may serve text alone (Qwen3.5) when `limit_mm_per_prompt` turns images off."""
    try:
        model_cls = resolve_model_class(architectures)
    except ValueError:
        return False
    if serves_text_only(model_cls, limit_mm_per_prompt):
        return False
    return bool(getattr(model_cls, "is_multimodal", False))


def is_speech_architecture(architectures: list[str]) -> bool:
    """Whether the model's encoder reads audio (Whisper): it serves transcriptions."""
    try:
        model_cls = resolve_model_class(architectures)
    except ValueError:
        return False
    return getattr(model_cls, "encoder_input_kind", None) == "audio"


def default_pooler_config(architectures: list[str]) -> PoolerConfig:
    """The pooling a model uses when its checkpoint and the caller say nothing."""
    model_cls = resolve_model_class(architectures)
    default = getattr(model_cls, "default_pooler_config", None)
    if default is None:
        raise ValueError(
            f"architecture {list(architectures)} has no pooling (it is not an embedding model)"
        )
    return PoolerConfig(default.pooling_type, default.normalize)
