"""BART (`BartForConditionalGeneration`), written token-wise: a text encoder and a decoder.

The engine runs a request's encoder once, in the step that admits it, and passes its tokens as
`encoder_input_ids` / `encoder_positions` (a flat stream of every encoder of that step, as the
decoder tokens are); in every other step the decoder runs alone and its cross-attention reads the
encoder's keys and values from the cache. Nothing here knows about batches or caches.

Architecture (post-LayerNorm): token embeddings (shared by encoder, decoder and the LM head;
scaled by sqrt(d_model) when `scale_embedding`) plus learned positions, which BART offsets by 2;
then `layernorm_embedding`. Encoder layers are `LN(x + self_attn(x))`, `LN(h + fc2(act(fc1(h))))`;
decoder layers add `LN(h + cross_attn(h, encoder))` between the two. Logits are the tied LM head
plus `final_logits_bias`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenwise.attention.utils import AttentionType
from tokenwise.config import EngineConfig
from tokenwise.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_act_fn,
)
from tokenwise.layers.weight_utils import load_stacked_weights
from tokenwise.models.encoder_decoder_layers import EncDecAttention, join

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


class BartStack(nn.Module):
    """Embeddings and layers of the encoder or the decoder (which share the token embedding)."""

    def __init__(
        self, config: EngineConfig, prefix: str, shared: VocabParallelEmbedding, decoder: bool
    ) -> None:
        super().__init__()
        hf = config.model.hf_config
        d = hf.d_model
        self.embed_scale = math.sqrt(d) if getattr(hf, "scale_embedding", False) else 1.0
        self._shared = [shared]  # a list: the embedding is registered once, under the model
        self.embed_positions = nn.Embedding(hf.max_position_embeddings + POSITION_OFFSET, d)
        self.layernorm_embedding = nn.LayerNorm(d)
        layer_cls = BartDecoderLayer if decoder else BartEncoderLayer
        num_layers = hf.decoder_layers if decoder else hf.encoder_layers
        self.layers = nn.ModuleList(
            layer_cls(config, join(prefix, f"layers.{i}")) for i in range(num_layers)
        )

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tokens = self._shared[0](input_ids) * self.embed_scale
        hidden = tokens + self.embed_positions(positions + POSITION_OFFSET)
        return self.layernorm_embedding(hidden)


class BartModel(nn.Module):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        self.shared = VocabParallelEmbedding(hf.vocab_size, hf.d_model)
        self.encoder = BartStack(config, join(prefix, "encoder"), self.shared, decoder=False)
        self.decoder = BartStack(config, join(prefix, "decoder"), self.shared, decoder=True)

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.encoder.embed(input_ids, positions)
        for layer in self.encoder.layers:
            hidden_states = layer(hidden_states)
        return hidden_states

    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
    ) -> torch.Tensor:
        hidden_states = self.decoder.embed(input_ids, positions)
        for layer in self.decoder.layers:
            hidden_states = layer(hidden_states, encoder_hidden_states)
        return hidden_states


class BartForConditionalGeneration(nn.Module):
    is_encoder_decoder = True
    encoder_input_kind = "tokens"

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf = config.model.hf_config
        self.model = BartModel(config, join(prefix, "model"))
        self.lm_head = ParallelLMHead(hf.vocab_size, hf.d_model, tie_to=self.model.shared)
        # A parameter (not a buffer) so that it loads like the weights; HF may omit it: zeros.
        self.final_logits_bias = nn.Parameter(torch.zeros(1, hf.vocab_size), requires_grad=False)

    @classmethod
    def max_encoder_len(cls, hf_config: Any) -> int:
        return int(hf_config.max_position_embeddings)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        encoder_input_ids: torch.Tensor | None = None,
        encoder_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decoder hidden states; the encoder runs first when encoder tokens are given."""
        encoder_hidden_states = None
        if encoder_input_ids is not None:
            if encoder_positions is None:
                raise ValueError("encoder_input_ids need encoder_positions")
            encoder_hidden_states = self.model.encode(encoder_input_ids, encoder_positions)
        return self.model.decode(input_ids, positions, encoder_hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states) + self.final_logits_bias.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named tensors in; the tied copies of the shared embedding are skipped."""
        tied = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
        tied += ("lm_head.weight",)
        kept = ((name, tensor) for name, tensor in weights if name not in tied)
        return load_stacked_weights(self, kept, ()) | {"final_logits_bias"}
