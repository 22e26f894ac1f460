"""Gemma 4 settings from a GGUF file's metadata, as llama.cpp's converter writes them.

The converter states Gemma 4's layer geometry per layer where it varies and keeps Gemma 3's
keys otherwise:
- `attention.sliding_window_pattern`: one flag per layer (True: sliding);
- `attention.key_length` is the *global* layers' head size, `attention.key_length_swa` the
  sliding layers'; `attention.head_count_kv` and `feed_forward_length` may be arrays, one
  value per layer (global layers' own KV heads; double-width MLPs in the KV-sharing layers);
- `attention.shared_kv_layers`, `embedding_length_per_layer_input` (0: no per-layer
  embeddings; the table's vocabulary is its tensor's row count);
- the global layers' proportional RoPE is the `rope_freqs` tensor: factor 1 for the rotated
  pairs and a huge one (frequency ~0) for the pairs that pass through;
- `attention_k_eq_v` is no key at all: the global layers just have no `attn_v` tensor;
- the MoE block (`expert_count`, `expert_used_count`, `expert_feed_forward_length`): experts
  stacked as `ffn_gate_up_exps` / `ffn_down_exps`, the router's input scale and per-expert
  scale as `ffn_gate_inp.scale` / `ffn_down_exps.scale` (`gemma4_tensor_names`).
Norms are stored as they are (Gemma 4's norms scale by `weight`, not `1 + weight`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

SLIDING, FULL = "sliding_attention", "full_attention"
# A rope factor at least this large stops its pair rotating (the converter writes 1e30).
UNROTATED = 1e20


def _per_layer(value: Any, layers: int, what: str) -> list[int]:
    if isinstance(value, list):
        if len(value) != layers:
            raise ValueError(f"gemma4.{what} has {len(value)} values for {layers} layers")
        return [int(v) for v in value]
    return [int(value)] * layers


def _first_of(types: list[str], kind: str, values: list[int], what: str) -> int:
    """The one value all layers of `kind` share (an error names the key if they differ)."""
    of_kind = {v for v, t in zip(values, types, strict=True) if t == kind}
    if len(of_kind) > 1:
        raise NotImplementedError(f"gemma4.{what} differs between {kind} layers: {of_kind}")
    return of_kind.pop() if of_kind else values[0]


def proportional_rope(factors: np.ndarray, global_dim: int, path: str) -> float:
    """`partial_rotary_factor` of the global layers from the file's `rope_freqs`."""
    if factors.size != global_dim // 2:
        raise ValueError(
            f"GGUF file {path!r}: rope_freqs.weight holds {factors.size} factors, the global "
            f"head of {global_dim} needs {global_dim // 2}"
        )
    rotated = int((factors == 1.0).sum())
    if not ((factors[:rotated] == 1.0).all() and (factors[rotated:] >= UNROTATED).all()):
        raise NotImplementedError(
            f"GGUF file {path!r}: Gemma 4's rope_freqs.weight must rotate the first pairs "
            "(factor 1) and leave the rest (factor >= 1e20), as llama.cpp writes proportional "
            "RoPE; other factors are not supported"
        )
    return rotated / (global_dim // 2)


def gemma4_kwargs(
    metadata: dict[str, Any],
    names: tuple[str, ...],
    shapes: dict[str, tuple[int, ...]],
    rope_factors: np.ndarray | None,
    base: dict[str, Any],
    path: str,
) -> dict[str, Any]:
    """The `gemma4_text` config arguments; `base` holds the common ones already read.
    `shapes` are tensor shapes in HF order (rows first); `rope_factors` the `rope_freqs`."""

    def get(name: str, default: Any = None) -> Any:
        value = metadata.get(f"gemma4.{name}", default)
        if value is None:
            raise ValueError(f"GGUF file {path!r} lacks the metadata key gemma4.{name}")
        return value

    layers = base["num_hidden_layers"]
    pattern = get("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ValueError(
            f"GGUF file {path!r}: gemma4.attention.sliding_window_pattern must hold one flag "
            f"per layer ({layers})"
        )
    types = [SLIDING if flag else FULL for flag in pattern]
    global_dim = int(get("attention.key_length"))
    head_dim = int(get("attention.key_length_swa", global_dim))
    if int(get("rope.dimension_count_swa", head_dim)) != head_dim:
        raise NotImplementedError(
            f"GGUF file {path!r}: Gemma 4 sliding layers that rotate part of the head "
            "(rope.dimension_count_swa) are not supported"
        )
    kv = _per_layer(get("attention.head_count_kv"), layers, "attention.head_count_kv")
    ffn = _per_layer(get("feed_forward_length"), layers, "feed_forward_length")
    shared = int(get("attention.shared_kv_layers", 0))
    first_shared = layers - shared
    kv_sliding, kv_global = (
        _first_of(types, t, kv, "attention.head_count_kv") for t in (SLIDING, FULL)
    )
    # Global layers without a value projection use the key as value (transformers'
    # attention_k_eq_v); the first global layer that computes its own K/V tells.
    owner = next((i for i in range(first_shared) if types[i] == FULL), None)
    k_eq_v = owner is not None and f"blk.{owner}.attn_v.weight" not in names
    if kv_global != kv_sliding and not k_eq_v:
        raise NotImplementedError(
            f"GGUF file {path!r}: Gemma 4 global layers with their own KV head count need "
            "attention_k_eq_v (no attn_v), as transformers defines them"
        )
    wide = [f == 2 * ffn[0] for f in ffn[first_shared:]]
    if any(f != ffn[0] for f in ffn[:first_shared]) or (shared and len(set(wide)) > 1):
        raise NotImplementedError(
            f"GGUF file {path!r}: gemma4.feed_forward_length {ffn} is not one width, doubled "
            "at most in the KV-sharing layers"
        )
    ple = int(get("embedding_length_per_layer_input", 0))
    partial = 1.0 if rope_factors is None else proportional_rope(rope_factors, global_dim, path)
    kwargs: dict[str, Any] = {
        "head_dim": head_dim,
        "global_head_dim": global_dim,
        "num_key_value_heads": kv_sliding,
        "attention_k_eq_v": k_eq_v,
        "intermediate_size": ffn[0],
        "use_double_wide_mlp": bool(shared and all(wide) and ffn[-1] != ffn[0]),
        "num_kv_shared_layers": shared,
        "layer_types": types,
        "sliding_window": int(get("attention.sliding_window")),
        "final_logit_softcapping": metadata.get("gemma4.final_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size_per_layer_input": ple,
        "rope_parameters": {
            SLIDING: {
                "rope_type": "default",
                "rope_theta": float(get("rope.freq_base_swa", 10000.0)),
            },
            FULL: {
                "rope_type": "proportional",
                "partial_rotary_factor": partial,
                "rope_theta": float(get("rope.freq_base")),
            },
        },
    }
    experts = int(metadata.get("gemma4.expert_count") or 0)
    if experts:  # the 26B-A4B block: routed experts beside every MLP
        kwargs["enable_moe_block"] = True
        kwargs["num_experts"] = experts
        kwargs["top_k_experts"] = int(get("expert_used_count"))
        kwargs["moe_intermediate_size"] = int(get("expert_feed_forward_length"))
    if k_eq_v:
        kwargs["num_global_key_value_heads"] = kv_global
    if ple:
        kwargs["vocab_size_per_layer_input"] = shapes["per_layer_token_embd.weight"][0]
    return kwargs


def gemma4_tensor_names(num_layers: int) -> dict[str, str]:
    """GGUF -> HF names of the MoE tensors gguf-py's name map does not give back: the
    stacked experts (HF names without `.weight`) and the router's two scales, which the
    converter stores as `.scale` tensors beside the router and the down experts."""
    names: dict[str, str] = {}
    for i in range(num_layers):
        hf, blk = f"model.layers.{i}", f"blk.{i}"
        names[f"{blk}.ffn_gate_up_exps.weight"] = f"{hf}.experts.gate_up_proj"
        names[f"{blk}.ffn_down_exps.weight"] = f"{hf}.experts.down_proj"
        names[f"{blk}.ffn_gate_inp.scale"] = f"{hf}.router.scale"
        names[f"{blk}.ffn_down_exps.scale"] = f"{hf}.router.per_expert_scale"
    return names
