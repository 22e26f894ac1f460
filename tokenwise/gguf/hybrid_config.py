"""Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) from a GGUF file's metadata.

llama.cpp's converter (`qwen35`, `qwen35moe`, `qwen3next`) writes the linear-attention
geometry under Mamba's `ssm.*` keys:
- `ssm.conv_kernel` is `linear_conv_kernel_dim`, `ssm.state_size` the key head size,
  `ssm.group_count` the key heads, `ssm.time_step_rank` the value heads and `ssm.inner_size`
  all value heads' width (so the value head size is `inner_size / time_step_rank`);
- `attention.recurrent_layers`: one flag per block (True: linear attention), the config's
  `layer_types`; blocks past the decoder are the MTP head's (`nextn_predict_layers` of them),
  which this loader skips, as it skips the `mtp.*` tensors of a checkpoint directory;
- `rope.dimension_count` is the rotated part of each head (`partial_rotary_factor * head_dim`)
  and Qwen3.5's `rope.dimension_sections` its multimodal RoPE sections (plain RoPE for text).
The MoE keys are Qwen2-MoE's (`moe_config`); llama.cpp renormalises the top-k weights of both
MoE families, as transformers does.
"""

from __future__ import annotations

from typing import Any

LINEAR, FULL = "linear_attention", "full_attention"
GDN_ARCHS = ("qwen35", "qwen35moe", "qwen3next")


def decoder_layers(metadata: dict[str, Any], arch: str) -> int:
    """Blocks of the decoder: the file's `block_count` less the MTP blocks after them."""
    blocks = metadata.get(f"{arch}.block_count")
    if blocks is None:
        raise ValueError(f"a GGUF file of a {arch!r} model lacks the key {arch}.block_count")
    return int(blocks) - int(metadata.get(f"{arch}.nextn_predict_layers") or 0)


def gdn_kwargs(metadata: dict[str, Any], arch: str, base: dict[str, Any], path: str) -> dict:
    """The hybrid's config arguments; `base` holds the common ones already read."""

    def get(name: str) -> Any:
        value = metadata.get(f"{arch}.{name}")
        if value is None:
            raise ValueError(f"GGUF file {path!r} lacks the metadata key {arch}.{name}")
        return value

    layers = decoder_layers(metadata, arch)
    flags = get("attention.recurrent_layers")
    if not isinstance(flags, list) or len(flags) < layers:
        raise ValueError(
            f"GGUF file {path!r}: {arch}.attention.recurrent_layers must hold one flag per "
            f"layer ({layers})"
        )
    value_heads = int(get("ssm.time_step_rank"))
    inner = int(get("ssm.inner_size"))
    if value_heads <= 0 or inner % value_heads:
        raise ValueError(
            f"GGUF file {path!r}: {arch}.ssm.inner_size ({inner}) must be a multiple of "
            f"{arch}.ssm.time_step_rank ({value_heads}), the value heads"
        )
    head_dim = base["head_dim"]
    rotated = int(metadata.get(f"{arch}.rope.dimension_count") or head_dim)
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(base.get("rope_theta", 10000.0)),
        "partial_rotary_factor": rotated / head_dim,
    }
    sections = metadata.get(f"{arch}.rope.dimension_sections")
    if arch != "qwen3next" and sections:
        rope["mrope_section"] = [int(s) for s in sections[:3]]
        rope["mrope_interleaved"] = True
    kwargs: dict[str, Any] = {
        "num_hidden_layers": layers,
        "layer_types": [LINEAR if flags[i] else FULL for i in range(layers)],
        "full_attention_interval": int(metadata.get(f"{arch}.full_attention_interval") or 4),
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
        "linear_key_head_dim": int(get("ssm.state_size")),
        "linear_num_key_heads": int(get("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads,
        "rope_parameters": rope,
        "partial_rotary_factor": rotated / head_dim,
        "attention_bias": False,
    }
    return kwargs
