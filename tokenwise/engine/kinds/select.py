"""Which model kind a configuration serves: embed, encoder-decoder, multimodal, or generate."""

from __future__ import annotations

from tokenwise.config import EngineConfig
from tokenwise.engine.kinds.base import ModelKind
from tokenwise.engine.kinds.encoder_decoder import EncoderDecoderKind
from tokenwise.engine.kinds.generate import GenerateKind
from tokenwise.engine.kinds.multimodal import MultiModalKind
from tokenwise.engine.kinds.pooling import EmbedKind
from tokenwise.models.registry import is_encoder_decoder_architecture, is_multimodal_architecture


def model_kind_for(config: EngineConfig) -> type[ModelKind]:
    """The kind of `config.model`: `task="embed"` pools, an encoder-decoder architecture (BART,
    Whisper) has cross attention, anything else generates from a decoder."""
    if config.model is None:
        raise ValueError("choosing a model kind needs EngineConfig.model")
    if config.model.is_pooling:
        return EmbedKind
    if is_encoder_decoder_architecture(config.model.architectures):
        return EncoderDecoderKind
    if is_multimodal_architecture(config.model.architectures, config.model.limit_mm_per_prompt):
        return MultiModalKind
    return GenerateKind
