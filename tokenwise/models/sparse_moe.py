"""What Mixtral, Qwen2-MoE and Qwen3-MoE share: a routed-experts block and expert loading.

All three are the Llama decoder with some feed-forward blocks replaced by a router (`gate`, a
plain linear to one logit per expert) and routed experts (`experts`, a `FusedMoE`); module
names follow the checkpoints so that only the expert tensors need routing at load time. A
subclass says which layers are sparse and how routing weights are treated (`make_mlp`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.layers import ReplicatedLinear
from tokenwise.layers.fused_moe import (
    FusedMoE,
    load_weights_with_experts,
    make_expert_params_mapping,
)
from tokenwise.models.llama import LlamaForCausalLM


class SparseMoeBlock(nn.Module):
    """Router logits, then the routed experts (no shared expert)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        weights_in_fp32: bool,
        prefix: str,
    ) -> None:
        super().__init__()
        hf = config.model.hf_config
        self.gate = ReplicatedLinear(hf.hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(
            num_experts,
            top_k,
            hf.hidden_size,
            intermediate_size,
            config,
            renormalize=renormalize,
            hidden_act=hf.hidden_act,
            weights_in_fp32=weights_in_fp32,
            prefix=f"{prefix}.experts" if prefix else "experts",
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


def qwen_moe_routing(hf_config: Any) -> dict[str, Any]:
    """The `SparseMoeBlock` arguments Qwen2-MoE and Qwen3-MoE configs spell alike: routing
    weights renormalised only with `norm_topk_prob`, and rounded to the activation dtype."""
    return {
        "num_experts": int(hf_config.num_experts),
        "top_k": int(hf_config.num_experts_per_tok),
        "intermediate_size": int(hf_config.moe_intermediate_size),
        "renormalize": bool(hf_config.norm_topk_prob),
        "weights_in_fp32": False,
    }


def is_sparse_layer(hf_config: Any, layer_idx: int) -> bool:
    """Qwen-MoE's rule: every `decoder_sparse_step`-th layer, except `mlp_only_layers`."""
    if layer_idx in (getattr(hf_config, "mlp_only_layers", None) or []):
        return False
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    return int(hf_config.num_experts) > 0 and (layer_idx + 1) % step == 0


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose feed-forward blocks are (partly) mixtures of experts."""

    # The engine reads this to know that the model has expert layers (DP shards them).
    is_moe: ClassVar[bool] = True
    # Checkpoint names of an expert's gate / up / down projections.
    expert_proj_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    # Checkpoint module name -> this model's (Mixtral's `block_sparse_moe` is `mlp` here).
    checkpoint_renames: ClassVar[Mapping[str, str]] = {}

    def num_experts(self) -> int:
        return max((m.num_experts for m in self.modules() if isinstance(m, FusedMoE)), default=0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        kept = ((name, tensor) for name, tensor in weights if not self._ignored(name))
        experts = make_expert_params_mapping(self.num_experts(), *self.expert_proj_names)
        return load_weights_with_experts(
            self, kept, self.stacked_params_mapping, experts, self.checkpoint_renames
        )
