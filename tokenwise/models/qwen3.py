"""Qwen3: the Llama decoder with an RMSNorm over every q and k head before RoPE.

The per-head norm keeps attention logits bounded without q/k biases (Qwen2 had them), and the
head size is set explicitly in the config rather than being hidden_size / num_heads, which
`ModelConfig.head_dim` already honours. Biases follow `attention_bias`, as in Llama.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from tokenwise.attention.utils import AttentionType
from tokenwise.config import EngineConfig, PoolerConfig
from tokenwise.models.llama import DecoderVariant, LlamaForCausalLM, LlamaModel


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_variant(cls, hf_config: Any) -> DecoderVariant:
        return replace(super().decoder_variant(hf_config), qk_norm=True)


class Qwen3ForSequenceClassification(Qwen3ForCausalLM):
    """Qwen3 with a `score` head (no bias) instead of the LM head: a classifier or reward
    model, and the form Qwen3 rerankers are converted to for serving as cross-encoders.

    HF scores the last token of each sequence; the engine's pooler picks that row (LAST
    pooling) and `classify` projects it. Each prompt is read whole, in one step, with causal
    attention and no KV cache (`DECODER_NO_CACHE`): nothing is generated after it. Its
    forward returns the last hidden states of every token; under pipeline parallelism the last
    stage's go back to the driver, which pools them (the score head loads on every stage).
    """

    is_pooling_model = True
    is_classifier = True
    default_pooler_config = PoolerConfig(pooling_type="LAST", normalize=False)

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        hf = config.model.hf_config
        prefix = f"{prefix}.model" if prefix else "model"
        self.model = LlamaModel(config, self.decoder_variant(hf), prefix)
        self.tie_word_embeddings = False  # the score head is never tied
        self._head_from_embedding = False
        self.score = nn.Linear(hf.hidden_size, int(getattr(hf, "num_labels", 2)), bias=False)

    @classmethod
    def decoder_variant(cls, hf_config: Any) -> DecoderVariant:
        variant = super().decoder_variant(hf_config)
        return replace(variant, attn_type=AttentionType.DECODER_NO_CACHE)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """float32 logits `[num_seqs, num_labels]` of each sequence's last hidden state."""
        return self.score(pooled.to(self.score.weight.dtype)).float()
