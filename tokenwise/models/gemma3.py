"""Gemma 3's text model: Gemma 2 plus q/k head norms and separate RoPE for sliding layers.

Gemma 3 drops attention soft-capping in favour of the q/k norms (its configs set
`attn_logit_softcapping` to None, which `GemmaAttention` honours) and gives global layers a
long-context RoPE base (often with linear scaling) while sliding layers keep a short one.
"""

from __future__ import annotations

from tokenwise.models.gemma2 import Gemma2ForCausalLM, GemmaVariant


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    variant = GemmaVariant(qk_norm=True, rope_per_layer_type=True)
