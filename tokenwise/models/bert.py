"""BERT and XLM-RoBERTa encoders, written token-wise, for embeddings.

An encoder sees whole prompts and attends bidirectionally: the attention layer is built with
`AttentionType.ENCODER_ONLY` and learns from the forward context where each sequence of the flat
token stream starts and ends, exactly as decoder attention does. Nothing here knows about
batches, and an encoder keeps no state between steps.

Architecture (post-LayerNorm, as in the original BERT): embeddings are word + token type (0 for
single-segment inputs; a cross-encoder's pair packs them into the ids, `token_types.py`) +
learned absolute position, then LayerNorm; each layer is
`LN(x + attn(x))` followed by `LN(h + W2 gelu(W1 h))`. The model returns the last hidden states;
pooling them into embeddings is the engine's job (`tokenwise.pooling`). XLM-RoBERTa is the same
network whose positions start after the padding index (`padding_idx + 1`), as HF's
`create_position_ids_from_input_ids` counts them for an unpadded sequence.

Module names follow HF's (`encoder.layer.3.attention.self`), so checkpoint tensors load by name;
q/k/v are fused into one `qkv_proj` matmul.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenwise.attention.layer import Attention
from tokenwise.attention.utils import AttentionType
from tokenwise.config import EngineConfig, PoolerConfig
from tokenwise.layers import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_act_fn,
)
from tokenwise.layers.weight_utils import load_stacked_weights
from tokenwise.models.token_types import split_token_types


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class BertEmbedding(nn.Module):
    def __init__(self, hf: Any, position_offset: int) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(hf.vocab_size, hf.hidden_size)
        self.position_embeddings = nn.Embedding(hf.max_position_embeddings, hf.hidden_size)
        self.token_type_embeddings = nn.Embedding(hf.type_vocab_size, hf.hidden_size)
        self.LayerNorm = nn.LayerNorm(hf.hidden_size, eps=hf.layer_norm_eps)
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # A cross-encoder's pair has its token types packed into the ids (`token_types.py`).
        input_ids, token_types = split_token_types(input_ids)
        embeddings = self.word_embeddings(input_ids) + self.token_type_embeddings(token_types)
        embeddings = embeddings + self.position_embeddings(positions + self.position_offset)
        return self.LayerNorm(embeddings)


class BertSelfAttention(nn.Module):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        num_heads = int(hf.num_attention_heads)
        self.head_dim = hf.hidden_size // num_heads
        self.qkv_proj = QKVParallelLinear(hf.hidden_size, self.head_dim, num_heads, num_heads, True)
        self.attn = Attention(
            self.qkv_proj.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            prefix=_join(prefix, "attn"),
            config=config,
            attn_type=AttentionType.ENCODER_ONLY,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split(self.qkv_proj.output_sizes, dim=-1)
        return self.attn(q, k, v)


class BertOutput(nn.Module):
    """A projection back to hidden size, then the post-LayerNorm over the residual sum."""

    def __init__(self, input_size: int, hf: Any) -> None:
        super().__init__()
        self.dense = RowParallelLinear(input_size, hf.hidden_size, bias=True)
        self.LayerNorm = nn.LayerNorm(hf.hidden_size, eps=hf.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden_states) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        # `self` is HF's module name (encoder.layer.N.attention.self), kept for loading.
        self.self = BertSelfAttention(config, _join(prefix, "self"))
        self.output = BertOutput(hf.hidden_size, hf)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden_states), hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, hf: Any) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(hf.hidden_size, hf.intermediate_size, bias=True)
        self.act_fn = get_act_fn(hf.hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.act_fn(self.dense(hidden_states))


class BertLayer(nn.Module):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        self.attention = BertAttention(config, _join(prefix, "attention"))
        self.intermediate = BertIntermediate(hf)
        self.output = BertOutput(hf.intermediate_size, hf)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        attn_out = self.attention(hidden_states)
        return self.output(self.intermediate(attn_out), attn_out)


class BertEncoder(nn.Module):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        num_layers = config.model.hf_config.num_hidden_layers
        self.layer = nn.ModuleList(
            BertLayer(config, _join(prefix, f"layer.{i}")) for i in range(num_layers)
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            hidden_states = layer(hidden_states)
        return hidden_states


class BertEmbeddingModel(nn.Module):
    """`BertModel` / `BertForMaskedLM` checkpoints as an embedding model: last hidden states.

    Without sentence-transformers files the engine pools with CLS and normalises
    (`default_pooler_config`): BERT's pre-training puts the sequence summary at [CLS] (the
    next-sentence objective reads it there), and unit-length vectors make a dot product the
    cosine similarity, which is how embeddings are compared (OpenAI's are unit length too).
    This is also vLLM's default for BERT embedding models, so both engines agree.
    """

    is_pooling_model = True
    default_pooler_config = PoolerConfig(pooling_type="CLS", normalize=True)
    stacked_params_mapping: tuple[tuple[str, str, str | int], ...] = (
        ("qkv_proj", "query", "q"),
        ("qkv_proj", "key", "k"),
        ("qkv_proj", "value", "v"),
    )
    # Prefixes of HF's task models (BertForMaskedLM holds `bert.`); heads that pooling does not
    # use (HF's tanh pooler, the masked-LM head) and position-id buffers older saves contain.
    checkpoint_prefixes: tuple[str, ...] = ("bert.",)
    ignored_prefixes: tuple[str, ...] = ("pooler.", "cls.")
    ignored_suffixes: tuple[str, ...] = ("position_ids", "token_type_ids")

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf = config.model.hf_config
        self.embeddings = BertEmbedding(hf, self.position_offset(hf))
        self.encoder = BertEncoder(config, _join(prefix, "encoder"))

    @classmethod
    def position_offset(cls, hf_config: Any) -> int:
        return 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embeddings(input_ids, positions))

    def _rename(self, name: str) -> str | None:
        """The parameter name a checkpoint tensor loads into, or None to skip it."""
        for head in self.checkpoint_prefixes:
            if name.startswith(head):
                name = name[len(head) :]
                break
        if name.startswith(self.ignored_prefixes) or name.endswith(self.ignored_suffixes):
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors in; returns the names of the parameters fully filled."""
        renamed = ((self._rename(name), tensor) for name, tensor in weights)
        kept = ((name, tensor) for name, tensor in renamed if name is not None)
        return load_stacked_weights(self, kept, self.stacked_params_mapping)


class XLMRobertaEmbeddingModel(BertEmbeddingModel):
    """XLM-RoBERTa (and RoBERTa): BERT's network; positions start at `padding_idx + 1`."""

    checkpoint_prefixes = ("roberta.",)
    ignored_prefixes = ("pooler.", "lm_head.")

    @classmethod
    def position_offset(cls, hf_config: Any) -> int:
        return int(hf_config.pad_token_id) + 1
