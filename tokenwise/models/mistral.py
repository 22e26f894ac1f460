"""Mistral: the Llama decoder with a sliding attention window.

`layer_sliding_window` (in llama.py) already passes `config.sliding_window` to every layer's
attention, so nothing but the name differs; the class exists so the registry can map
`MistralForCausalLM` to a type that says what it is.
"""

from __future__ import annotations

from tokenwise.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
