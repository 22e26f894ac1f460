"""Qwen3.5 (and Qwen3.6): the Qwen3-Next hybrid with the linear-attention projections by part.

The decoder is Qwen3-Next's (`qwen3_next.py`: Gated DeltaNet and gated full attention from
`layer_types`, zero-centred norms, partial RoPE). The linear-attention input projection is
stored as `in_proj_qkv`, `in_proj_z`, `in_proj_b` and `in_proj_a` instead of Qwen3-Next's
per-key-head groups. The dense models have a plain SwiGLU MLP in every layer; the MoE ones
(`Qwen3_5MoeForCausalLM`) routed experts plus a sigmoid-gated shared expert in every layer,
with the top-k weights always renormalised.

`Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration` (the published
checkpoints, with a vision tower) are these decoders plus the tower: `qwen3_5_vl.py`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.models.llama import LlamaForCausalLM
from tokenwise.models.qwen2_moe import Qwen2MoeSparseMoeBlock
from tokenwise.models.qwen3_next import Qwen3NextForCausalLM

_SPLIT_IN_PROJ = (
    ("in_proj", "in_proj_qkv", "qkv"),
    ("in_proj", "in_proj_z", "z"),
    ("in_proj", "in_proj_b", "b"),
    ("in_proj", "in_proj_a", "a"),
)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    is_moe: ClassVar[bool] = False
    stacked_params_mapping = (*LlamaForCausalLM.stacked_params_mapping, *_SPLIT_IN_PROJ)

    def make_mlp(self, config: EngineConfig, layer_idx: int, prefix: str) -> nn.Module | None:
        return None  # the dense SwiGLU MLP


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    is_moe: ClassVar[bool] = True

    def make_mlp(self, config: EngineConfig, layer_idx: int, prefix: str) -> nn.Module | None:
        hf: Any = config.model.hf_config
        if getattr(hf, "norm_topk_prob", None) is None:
            hf.norm_topk_prob = True  # Qwen3.5-MoE always renormalises (its config has no key)
        return Qwen2MoeSparseMoeBlock(config, prefix)
