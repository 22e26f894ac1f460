"""The attention block shared by the encoder-decoder models (BART, Whisper): separate q/k/v
projections.

Module names are HF's (`self_attn.q_proj`, `encoder_attn.k_proj`), so checkpoint tensors
load by name. One attention module serves the three uses; the attention layer's type says which:
the encoder's bidirectional self-attention (`ENCODER`), the decoder's causal self-attention
(`DECODER`) and cross-attention (`ENCODER_DECODER`), whose keys and values are projections of
the encoder output. The encoder output exists only in a step where some encoder runs; in other
steps cross-attention gets no new keys and values (zero rows) and reads what its cache holds.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenwise.attention.layer import Attention
from tokenwise.attention.utils import AttentionType
from tokenwise.config import EngineConfig
from tokenwise.layers import ColumnParallelLinear, RowParallelLinear


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class EncDecAttention(nn.Module):
    """Multi-head attention with biased q/v/out projections (`k_bias`: BART yes, Whisper no)."""

    def __init__(
        self,
        config: EngineConfig,
        embed_dim: int,
        num_heads: int,
        attn_type: AttentionType,
        prefix: str,
        k_bias: bool = True,
    ) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"d_model {embed_dim} is not a multiple of {num_heads} heads")
        head_dim = embed_dim // num_heads
        self.embed_dim = embed_dim
        self.q_proj = ColumnParallelLinear(embed_dim, embed_dim, bias=True)
        self.k_proj = ColumnParallelLinear(embed_dim, embed_dim, bias=k_bias)
        self.v_proj = ColumnParallelLinear(embed_dim, embed_dim, bias=True)
        self.out_proj = RowParallelLinear(embed_dim, embed_dim, bias=True)
        self.is_cross = attn_type is AttentionType.ENCODER_DECODER
        self.attn = Attention(
            num_heads,
            head_dim,
            head_dim**-0.5,
            prefix=join(prefix, "attn"),
            config=config,
            attn_type=attn_type,
        )

    def forward(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None
    ) -> torch.Tensor:
        q = self.q_proj(hidden_states)
        if not self.is_cross:
            source: torch.Tensor | None = hidden_states
        else:
            source = encoder_hidden_states
        if source is None:  # cross-attention in a step without encoders: keys are cached
            k = v = hidden_states.new_empty((0, self.embed_dim))
        else:
            k, v = self.k_proj(source), self.v_proj(source)
        return self.out_proj(self.attn(q, k, v))
