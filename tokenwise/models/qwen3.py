"""Qwen3: the Llama decoder with an RMSNorm over every q and k head before RoPE.

The per-head norm keeps attention logits bounded without q/k biases (Qwen2 had them), and the
head size is set explicitly in the config rather than being hidden_size / num_heads, which
`ModelConfig.head_dim` already honours. Biases follow `attention_bias`, as in Llama.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tokenwise.models.llama import DecoderVariant, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_variant(cls, hf_config: Any) -> DecoderVariant:
        return replace(super().decoder_variant(hf_config), qk_norm=True)
