"""BART (`BartForConditionalGeneration`), written token-wise: a text encoder and a decoder.

The engine runs a request's encoder once, in the step that admits it, and passes its tokens as
`encoder_input_ids` / `encoder_positions` (a flat stream of every encoder of that step, as the
decoder tokens are); in every other step the decoder runs alone and its cross-attention reads the
encoder's keys and values from the cache. Nothing here knows about batches or caches.

Architecture (post-LayerNorm): token embeddings (shared by encoder, decoder and the LM head;
scaled by sqrt(d_model) when `scale_embedding`) plus learned positions, which BART offsets by 2;
then `layernorm_embedding`. Encoder layers are `LN(x + self_attn(x))`, `LN(h + fc2(act(fc1(h))))`;
decoder layers add `LN(h + cross_attn(h, encoder))` between the two. Logits are the tied LM head
plus `final_logits_bias`. Under pipeline parallelism the decoder's layers are split over the
stages, the encoder is the first stage's (`encoder_decoder_stages.py`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenwise.attention.utils import AttentionType
from tokenwise.config import EngineConfig
from tokenwise.distributed.pp_state import is_first_pp_stage, is_last_pp_stage
from tokenwise.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_act_fn,
)
from tokenwise.layers.pipeline import IntermediateTensors, held_by_stage, only_on
from tokenwise.layers.weight_utils import load_stacked_weights
from tokenwise.models.encoder_decoder_layers import EncDecAttention, join
from tokenwise.models.encoder_decoder_stages import EncoderDecoderModel, StagedDecoder

# BART's learned position table starts two rows in (a quirk of fairseq's padding offset).
POSITION_OFFSET = 2


class BartEncoderLayer(nn.Module):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        d = hf.d_model
        self.self_attn = EncDecAttention(
            config, d, hf.encoder_attention_heads, AttentionType.ENCODER, join(prefix, "self_attn")
        )
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = ColumnParallelLinear(d, hf.encoder_ffn_dim, bias=True)
        self.fc2 = RowParallelLinear(hf.encoder_ffn_dim, d, bias=True)
        self.activation_fn = get_act_fn(hf.activation_function)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.self_attn_layer_norm(hidden_states + self.self_attn(hidden_states))
        ffn = self.fc2(self.activation_fn(self.fc1(hidden_states)))
        return self.final_layer_norm(hidden_states + ffn)


class BartDecoderLayer(nn.Module):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        d, heads = hf.d_model, hf.decoder_attention_heads
        self.self_attn = EncDecAttention(
            config, d, heads, AttentionType.DECODER, join(prefix, "self_attn")
        )
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = EncDecAttention(
            config, d, heads, AttentionType.ENCODER_DECODER, join(prefix, "encoder_attn")
        )
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = ColumnParallelLinear(d, hf.decoder_ffn_dim, bias=True)
        self.fc2 = RowParallelLinear(hf.decoder_ffn_dim, d, bias=True)
        self.activation_fn = get_act_fn(hf.activation_function)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None
    ) -> torch.Tensor:
        hidden_states = self.self_attn_layer_norm(hidden_states + self.self_attn(hidden_states))
        cross = self.encoder_attn(hidden_states, encoder_hidden_states)
        hidden_states = self.encoder_attn_layer_norm(hidden_states + cross)
        ffn = self.fc2(self.activation_fn(self.fc1(hidden_states)))
        return self.final_layer_norm(hidden_states + ffn)


def bart_embed(
    stack: BartEncoder | BartDecoder, input_ids: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Scaled shared token embeddings plus learned positions (offset by 2), then LayerNorm."""
    tokens = stack.shared[0](input_ids) * stack.embed_scale
    hidden = tokens + stack.embed_positions(positions + POSITION_OFFSET)
    return stack.layernorm_embedding(hidden)


class BartEncoder(nn.Module):
    """The encoder (on the first pipeline stage only): embeddings and every encoder layer."""

    def __init__(self, config: EngineConfig, prefix: str, shared: nn.Module) -> None:
        super().__init__()
        hf = config.model.hf_config
        d = hf.d_model
        self.embed_scale = math.sqrt(d) if getattr(hf, "scale_embedding", False) else 1.0
        self.shared = [shared]  # a list: the embedding is registered once, under the model
        self.embed_positions = nn.Embedding(hf.max_position_embeddings + POSITION_OFFSET, d)
        self.layernorm_embedding = nn.LayerNorm(d)
        self.layers = nn.ModuleList(
            BartEncoderLayer(config, join(prefix, f"layers.{i}")) for i in range(hf.encoder_layers)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = bart_embed(self, input_ids, positions)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states


class BartDecoder(StagedDecoder):
    """This pipeline stage's decoder layers; the embeddings on the first stage."""

    def __init__(self, config: EngineConfig, prefix: str, shared: nn.Module) -> None:
        super().__init__()
        hf = config.model.hf_config
        d = hf.d_model
        stage = self.build_stage(
            hf.decoder_layers, lambda i: BartDecoderLayer(config, join(prefix, f"layers.{i}"))
        )
        self.embed_scale = math.sqrt(d) if getattr(hf, "scale_embedding", False) else 1.0
        self.shared = [shared]
        self.embed_positions = only_on(
            stage.is_first, lambda: nn.Embedding(hf.max_position_embeddings + POSITION_OFFSET, d)
        )
        self.layernorm_embedding = only_on(stage.is_first, lambda: nn.LayerNorm(d))

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return bart_embed(self, input_ids, positions)


class BartModel(EncoderDecoderModel):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        first, last = is_first_pp_stage(), is_last_pp_stage()
        # The token embedding serves the encoder and the decoder (first stage) and the tied LM
        # head (last stage); a stage in between holds none of them.
        self.shared = only_on(
            first or last, lambda: VocabParallelEmbedding(hf.vocab_size, hf.d_model)
        )
        self.encoder = only_on(
            first, lambda: BartEncoder(config, join(prefix, "encoder"), self.shared)
        )
        self.decoder = BartDecoder(config, join(prefix, "decoder"), self.shared)


class BartForConditionalGeneration(nn.Module):
    is_encoder_decoder = True
    encoder_input_kind = "tokens"
    # Runs as pipeline stages, which split the decoder's layers (`encoder_decoder_stages.py`).
    supports_pp = True
    pp_layers_field = "decoder_layers"

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf = config.model.hf_config
        self.model = BartModel(config, join(prefix, "model"))
        self.is_last_stage = self.model.decoder.is_last_stage
        self.lm_head = only_on(
            self.is_last_stage,
            lambda: ParallelLMHead(hf.vocab_size, hf.d_model, tie_to=self.model.shared),
        )
        if self.is_last_stage:
            # A parameter (not a buffer) so that it loads like the weights; HF may omit it.
            bias = torch.zeros(1, hf.vocab_size)
            self.final_logits_bias = nn.Parameter(bias, requires_grad=False)

    @classmethod
    def max_encoder_len(cls, hf_config: Any) -> int:
        return int(hf_config.max_position_embeddings)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        encoder_input_ids: torch.Tensor | None = None,
        encoder_positions: torch.Tensor | None = None,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Decoder hidden states (this stage's hand-over before the last stage); the encoder
        runs first when encoder tokens are given (first stage)."""
        encoder_hidden_states = None
        if encoder_input_ids is not None:
            if encoder_positions is None:
                raise ValueError("encoder_input_ids need encoder_positions")
            encoder_hidden_states = self.model.encoder(encoder_input_ids, encoder_positions)
        return self.model.decoder(input_ids, positions, encoder_hidden_states, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states) + self.final_logits_bias.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named tensors in (this pipeline stage's only); the tied copies of the shared
        embedding are skipped."""
        tied = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
        tied += ("lm_head.weight",)
        kept = (
            (name, tensor)
            for name, tensor in weights
            if name not in tied
            and (self.is_last_stage if name == "final_logits_bias" else held_by_stage(self, name))
        )
        loaded = load_stacked_weights(self, kept, ())
        return loaded | ({"final_logits_bias"} if self.is_last_stage else set())
