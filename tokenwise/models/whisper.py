"""Whisper (`WhisperForConditionalGeneration`), written token-wise: an audio encoder and a decoder.

The engine runs a request's encoder once, in the step that admits it, and passes the log-mel
features of every encoder of that step as `encoder_input_features` (`[n, num_mel_bins, frames]`,
each clip padded to the model's window, as Whisper's feature extractor does); the encoder turns
each into exactly `max_source_positions` tokens, flattened into one stream. In every other step
the decoder runs alone, its cross-attention reading the encoder's keys and values from the cache.

Architecture (pre-LayerNorm): two 1-D convolutions with GELU (the second halves the frames),
plus fixed position embeddings (stored in the checkpoint), then encoder layers
`x + self_attn(LN(x))`, `h + fc2(gelu(fc1(LN(h))))` and a final LayerNorm. The decoder embeds
tokens plus learned positions (no offset), its layers add `h + cross_attn(LN(h), encoder)`, and
a final LayerNorm precedes the LM head (`proj_out`, tied to the token embedding). k_proj has no
bias. Under pipeline parallelism the decoder's layers are split over the stages, the encoder is
the first stage's (`encoder_decoder_stages.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenwise.attention.utils import AttentionType
from tokenwise.config import EngineConfig
from tokenwise.distributed.pp_state import is_first_pp_stage
from tokenwise.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_act_fn,
)
from tokenwise.layers.pipeline import IntermediateTensors, only_on, stage_lm_head, stage_weights
from tokenwise.layers.weight_utils import load_stacked_weights
from tokenwise.models.encoder_decoder_layers import EncDecAttention, join
from tokenwise.models.encoder_decoder_stages import EncoderDecoderModel, StagedDecoder


class WhisperLayer(nn.Module):
    """An encoder layer, or (`decoder=True`) a decoder layer with cross-attention."""

    def __init__(self, config: EngineConfig, prefix: str, decoder: bool) -> None:
        super().__init__()
        hf = config.model.hf_config
        d = hf.d_model
        heads = hf.decoder_attention_heads if decoder else hf.encoder_attention_heads
        ffn = hf.decoder_ffn_dim if decoder else hf.encoder_ffn_dim
        kind = AttentionType.DECODER if decoder else AttentionType.ENCODER
        self.self_attn = EncDecAttention(
            config, d, heads, kind, join(prefix, "self_attn"), k_bias=False
        )
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn: EncDecAttention | None = None
        if decoder:
            self.encoder_attn = EncDecAttention(
                config,
                d,
                heads,
                AttentionType.ENCODER_DECODER,
                join(prefix, "encoder_attn"),
                k_bias=False,
            )
            self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = ColumnParallelLinear(d, ffn, bias=True)
        self.fc2 = RowParallelLinear(ffn, d, bias=True)
        self.activation_fn = get_act_fn(hf.activation_function)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.self_attn_layer_norm(hidden_states))
        if self.encoder_attn is not None:
            normed = self.encoder_attn_layer_norm(hidden_states)
            hidden_states = hidden_states + self.encoder_attn(normed, encoder_hidden_states)
        ffn = self.fc2(self.activation_fn(self.fc1(self.final_layer_norm(hidden_states))))
        return hidden_states + ffn


class WhisperEncoder(nn.Module):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        d = hf.d_model
        self.conv1 = nn.Conv1d(hf.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(hf.max_source_positions, d)
        self.layers = nn.ModuleList(
            WhisperLayer(config, join(prefix, f"layers.{i}"), decoder=False)
            for i in range(hf.encoder_layers)
        )
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        """`[n, mel, frames]` -> `[n * max_source_positions, d_model]`, clip after clip."""
        frames = input_features.shape[-1]
        expected = 2 * self.embed_positions.num_embeddings
        if frames != expected:
            raise ValueError(f"Whisper's encoder takes {expected} mel frames, got {frames}")
        x = F.gelu(self.conv1(input_features.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [n, positions, d]
        hidden_states = (x + self.embed_positions.weight).flatten(0, 1)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.layer_norm(hidden_states)


class WhisperDecoder(StagedDecoder):
    """This pipeline stage's decoder layers; the embeddings on the first stage, the final
    LayerNorm on the last."""

    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        d = hf.d_model
        stage = self.build_stage(
            hf.decoder_layers,
            lambda i: WhisperLayer(config, join(prefix, f"layers.{i}"), decoder=True),
        )
        self.embed_tokens = only_on(
            stage.is_first, lambda: VocabParallelEmbedding(hf.vocab_size, d)
        )
        self.embed_positions = only_on(
            stage.is_first, lambda: nn.Embedding(hf.max_target_positions, d)
        )
        self.layer_norm = only_on(stage.is_last, lambda: nn.LayerNorm(d))

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) + self.embed_positions(positions)

    def finish(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(hidden_states)


class WhisperModel(EncoderDecoderModel):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        self.encoder = only_on(
            is_first_pp_stage(), lambda: WhisperEncoder(config, join(prefix, "encoder"))
        )
        self.decoder = WhisperDecoder(config, join(prefix, "decoder"))


class WhisperForConditionalGeneration(nn.Module):
    is_encoder_decoder = True
    encoder_input_kind = "audio"
    # Runs as pipeline stages, which split the decoder's layers (`encoder_decoder_stages.py`).
    supports_pp = True
    pp_layers_field = "decoder_layers"

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf = config.model.hf_config
        self.model = WhisperModel(config, join(prefix, "model"))
        # Tied to the token embedding; a last stage without it owns a copy of its tensor.
        self.proj_out, self._head_from_embedding = stage_lm_head(self.model.decoder, hf, True)

    @classmethod
    def max_encoder_len(cls, hf_config: Any) -> int:
        """Every clip becomes this many encoder tokens (audio is padded to the window)."""
        return int(hf_config.max_source_positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        encoder_input_features: torch.Tensor | None = None,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Decoder hidden states (this stage's hand-over before the last stage); the encoder
        runs first when features are given (first stage)."""
        encoder_hidden_states = None
        if encoder_input_features is not None:
            encoder_hidden_states = self.model.encoder(encoder_input_features)
        return self.model.decoder(input_ids, positions, encoder_hidden_states, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.proj_out(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named tensors in (this pipeline stage's only); `proj_out.weight` is the token
        embedding (tied)."""
        kept = ((name, tensor) for name, tensor in weights if name != "proj_out.weight")
        staged = stage_weights(
            self,
            kept,
            self._head_from_embedding,
            embedding="model.decoder.embed_tokens.weight",
            head="proj_out.weight",
        )
        return load_stacked_weights(self, staged, ())
