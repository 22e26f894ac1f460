"""Gemma 4's attention layout: each layer's head shape, which layers read another layer's KV
cache, and which pipeline splits the model can run with.

Kept apart from `gemma4.py` because the engine reads it before any model is built: the
pipeline launcher refuses a split here (`check_stage_split`), before starting the stages.
"""

from __future__ import annotations

from typing import Any

from tokenwise.models.gemma2 import SLIDING, gemma_layer_types


def layer_attention_shape(hf: Any, layer: int, layer_type: str) -> tuple[int, int]:
    """`(head_dim, num_key_value_heads)` of one layer: global layers differ from sliding ones.

    transformers 5.x resolves them per layer (`per_layer_config`); a plain config (GGUF, older
    files) says `global_head_dim` / `num_global_key_value_heads` for the global layers.
    """
    per_layer = getattr(hf, "per_layer_config", None)
    if per_layer is not None:
        lc = per_layer[layer]
        return int(lc.head_dim), int(lc.num_key_value_heads)
    head_dim, kv_heads = int(hf.head_dim), int(hf.num_key_value_heads)
    if layer_type != SLIDING:
        head_dim = int(getattr(hf, "global_head_dim", None) or head_dim)
        if getattr(hf, "attention_k_eq_v", False):
            kv_heads = int(getattr(hf, "num_global_key_value_heads", None) or kv_heads)
    return head_dim, kv_heads


def kv_producers(hf: Any, layer_types: list[str]) -> list[int | None]:
    """For each layer, the earlier layer whose KV cache it reads (None: its own).

    The last `num_kv_shared_layers` layers share; each reads the last non-sharing layer of
    its own type (transformers' `kv_sharing_modes`)."""
    n, shared = len(layer_types), int(getattr(hf, "num_kv_shared_layers", 0) or 0)
    first = n - shared
    out: list[int | None] = [None] * n
    for i in range(first, n):
        owners = [j for j in range(first) if layer_types[j] == layer_types[i]]
        if not owners:
            raise ValueError(
                f"Gemma 4 layer {i} ({layer_types[i]}) shares KV (num_kv_shared_layers="
                f"{shared}) but no earlier layer of that type computes any"
            )
        out[i] = owners[-1]
    return out


def check_stage_split(hf: Any, parts: list[int]) -> None:
    """Refuse a pipeline split (`parts`: layers per stage) Gemma 4 cannot run as stages.

    A KV-sharing layer must sit on the stage of the layer whose KV cache it reads. And the
    stages must hold the same kinds of KV cache in the same order: sliding and global layers
    have different head sizes, hence different KV-cache groups, and the engine lays out one
    set of groups (the first stage's) whose block tables every stage reads by group index.
    """
    layer_types = gemma_layer_types(hf)
    producers = kv_producers(hf, layer_types)
    stage_of = [stage for stage, count in enumerate(parts) for _ in range(count)]
    _check_kv_sharing_split(hf, parts, producers, stage_of)
    kinds: list[list[str]] = [[] for _ in parts]
    for layer, owner in enumerate(producers):
        head_dim, kv_heads = layer_attention_shape(hf, layer, layer_types[layer])
        kind = f"{kv_heads}x{head_dim}"
        if owner is None and kind not in kinds[stage_of[layer]]:
            kinds[stage_of[layer]].append(kind)
    if any(k != kinds[0] for k in kinds):
        raise ValueError(
            f"pipeline_parallel_size={len(parts)} splits the layers {parts}, which gives the "
            f"stages different kinds of KV cache (KV heads x head size, in layer order: "
            f"{kinds}); Gemma 4's sliding and global layers differ in head size, and every "
            "stage must hold the same kinds in the same order (the engine lays out one set of "
            "KV-cache groups for all stages): set TOKENWISE_PP_LAYER_PARTITION so that every "
            "stage starts with the same kind of layer and holds both"
        )


def _check_kv_sharing_split(
    hf: Any, parts: list[int], producers: list[int | None], stage_of: list[int]
) -> None:
    for layer, owner in enumerate(producers):
        if owner is not None and stage_of[owner] != stage_of[layer]:
            raise ValueError(
                f"pipeline_parallel_size={len(parts)} splits the layers {parts}, which puts "
                f"Gemma 4 layer {layer} on stage {stage_of[layer]} but layer {owner}, whose KV "
                f"cache it reads (num_kv_shared_layers={hf.num_kv_shared_layers}), on stage "
                f"{stage_of[owner]}: set TOKENWISE_PP_LAYER_PARTITION so that layers "
                f"{owner}-{layer} are on one stage"
            )
