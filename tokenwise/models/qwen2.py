"""Qwen2: the Llama decoder with biases on the q/k/v projections (but not on o_proj)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tokenwise.models.llama import DecoderVariant, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_variant(cls, hf_config: Any) -> DecoderVariant:
        return replace(super().decoder_variant(hf_config), qkv_bias=True, o_proj_bias=False)
