"""Mixtral: Mistral attention with every feed-forward block a mixture of experts.

Checkpoints call the block `block_sparse_moe` and the experts' projections `w1` (gate), `w3`
(up) and `w2` (down). Here, as in transformers 5, the block is `mlp`. Mixtral always
renormalises its top-k weights and scales expert outputs by them in float32 (HF never rounds
them to the activation dtype), which only matters below fp32. The sliding window, if the config
sets one, reaches every layer's attention as for Mistral.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.models.sparse_moe import MoeForCausalLM, SparseMoeBlock


class MixtralForCausalLM(MoeForCausalLM):
    is_moe: ClassVar[bool] = True
    expert_proj_names: ClassVar[tuple[str, str, str]] = ("w1", "w3", "w2")
    checkpoint_renames: ClassVar[Mapping[str, str]] = {"block_sparse_moe": "mlp"}

    def make_mlp(self, config: EngineConfig, layer_idx: int, prefix: str) -> nn.Module | None:
        hf = config.model.hf_config
        return SparseMoeBlock(
            config,
            num_experts=int(hf.num_local_experts),
            top_k=int(hf.num_experts_per_tok),
            intermediate_size=int(hf.intermediate_size),
            renormalize=True,
            weights_in_fp32=True,
            prefix=prefix,
        )
