"""Mixture-of-experts settings from a GGUF file's metadata (Mixtral, Qwen2-MoE, Qwen3-MoE,
Qwen3-Next, Qwen3.5-MoE).

llama.cpp writes the expert count and how many experts each token uses (`expert_count`,
`expert_used_count`), the experts' width where it differs from the dense MLP's
(`expert_feed_forward_length`, `expert_shared_feed_forward_length`) and, in newer files,
whether the top-k weights are renormalised (`expert_weights_norm`). Where that last key is
absent, its model code decides: Mixtral and Qwen3-MoE renormalise, Qwen2-MoE does not, so those
are the defaults here. Every layer is an MoE layer in the files llama.cpp writes for these.

A llama file with experts is Mixtral (llama.cpp has no separate Mixtral architecture).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# llama.cpp architecture -> whether its MoE graph renormalises the top-k weights.
RENORMALISES = {
    "llama": True,
    "qwen2moe": False,
    "qwen3moe": True,
    "qwen3next": True,
    "qwen35moe": True,
}
# Architectures with a sigmoid-gated shared expert beside the routed ones.
SHARED_EXPERT = ("qwen2moe", "qwen3next", "qwen35moe")


def expert_count(metadata: dict[str, Any], arch: str) -> int:
    return int(metadata.get(f"{arch}.expert_count") or 0)


def moe_kwargs(metadata: dict[str, Any], arch: str, key: Callable[[str], Any]) -> dict[str, Any]:
    """The config arguments of the MoE block (`key(name)` reads a required `{arch}.` key)."""
    experts, used = expert_count(metadata, arch), int(key("expert_used_count"))
    if not 0 < used <= experts:
        raise ValueError(
            f"{arch}.expert_used_count must be in [1, {arch}.expert_count={experts}], got {used}"
        )
    renormalise = bool(metadata.get(f"{arch}.expert_weights_norm", RENORMALISES[arch]))
    if arch == "llama":
        if not renormalise:
            raise NotImplementedError("a llama GGUF file with experts that are not renormalised")
        return {
            "num_local_experts": experts,
            "num_experts_per_tok": used,
            "sliding_window": metadata.get(f"{arch}.attention.sliding_window"),
        }
    kwargs: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "norm_topk_prob": renormalise,
        "moe_intermediate_size": int(key("expert_feed_forward_length")),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if arch in SHARED_EXPERT:
        kwargs["shared_expert_intermediate_size"] = int(key("expert_shared_feed_forward_length"))
    return kwargs
