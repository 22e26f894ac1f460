"""Write a tiny Qwen3.5 / Qwen3.5-MoE / Qwen3-Next / gpt-oss checkpoint as llama.cpp's
converter does (`convert_hf_to_gguf.py` of llama.cpp as vendored in llama-cpp-python 0.3.36:
`conversion/qwen.py`, `conversion/gpt_oss.py`), restated from its description with gguf-py's
writer and name map, since the converter ships in no installable package the tests could use.
`test_gguf_hybrids.test_the_real_converter_writes_the_same_file` compares the two where the
converter's source is at hand.

What the converter does to these checkpoints:
- metadata: the common keys (`_gguf_files`) plus the linear-attention geometry as `ssm.*`
  (conv kernel, key head size as `state_size`, key heads as `group_count`, value heads as
  `time_step_rank`, all value heads' width as `inner_size`), `attention.recurrent_layers`,
  `full_attention_interval`, the rotated width as `rope.dimension_count` and, for Qwen3.5,
  `rope.dimension_sections`; gpt-oss: the window, YaRN, the experts' width;
- Gated DeltaNet tensors: `A_log` stored as `-exp(A_log)`, `dt_bias` as `dt_proj.bias`, the
  conv weight squeezed, every RMSNorm but the gated one plus one; Qwen3-Next's `in_proj_qkvz`
  split into all q/k/v and all z; Qwen3.5's value heads reordered from grouped to tiled when
  there are fewer key heads;
- gpt-oss: `gate_up_proj` split into its interleaved gate and up rows, experts `[E, out, in]`,
  sinks as `attn_sinks.weight`; MXFP4 experts repacked into ggml's 17-byte blocks (the scale,
  then value i in the low and value i + 16 in the high nibble of byte i).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from tests.quantization._gguf_files import _tokenizer_metadata

ARCH_OF = {
    "qwen3_5_text": "qwen35",
    "qwen3_5_moe_text": "qwen35moe",
    "qwen3_next": "qwen3next",
    "gpt_oss": "gpt-oss",
}
EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")


def _common_metadata(writer: Any, config: dict[str, Any]) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])


def _gdn_metadata(writer: Any, config: dict[str, Any], arch: str) -> None:
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    flags = [t == "linear_attention" for t in config["layer_types"]]
    writer.add_array(f"{arch}.attention.recurrent_layers", flags)
    writer.add_full_attention_interval(config.get("full_attention_interval", 4))
    rope = config.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    writer.add_rope_dimension_count(int(config["head_dim"] * partial))
    if arch != "qwen3next":
        writer.add_rope_dimension_sections(rope.get("mrope_section") or [11, 11, 10, 0])


def _gpt_oss_metadata(writer: Any, config: dict[str, Any]) -> None:
    import gguf

    writer.add_sliding_window(config["sliding_window"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    rope = config["rope_parameters"]
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def _to_tiled(data: torch.Tensor, dim: int, nk: int, per_k: int, width: int) -> torch.Tensor:
    """The converter's value-head reorder: grouped by key head -> tiled, along `dim`."""
    shape = list(data.shape)
    grouped = data.reshape(*shape[:dim], nk, per_k, width, *shape[dim + 1 :])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def _gdn_tensor(name: str, data: torch.Tensor, config: dict[str, Any], arch: str) -> list:
    """`(HF-style name for the name map, data)` pairs of one checkpoint tensor."""
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    if arch != "qwen3next" and nk != nv and ".linear_attn." in name:
        per_k, qk = nv // nk, 2 * nk * dk
        if ".in_proj_qkv." in name:
            data = torch.cat([data[:qk], _to_tiled(data[qk:], 0, nk, per_k, dv)])
        elif ".in_proj_z." in name:
            data = _to_tiled(data, 0, nk, per_k, dv)
        elif ".in_proj_a." in name or ".in_proj_b." in name:
            data = _to_tiled(data, 0, nk, per_k, 1)
        elif name.endswith((".A_log", ".dt_bias")):
            data = _to_tiled(data, 0, nk, per_k, 1)
        elif ".conv1d." in name:
            data = torch.cat([data[:qk], _to_tiled(data[qk:], 0, nk, per_k, dv)])
        elif ".out_proj." in name:
            data = _to_tiled(data, 1, nk, per_k, dv)
    if name.endswith(".A_log"):
        data = -torch.exp(data)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        data = data.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        data = data + 1
    if "in_proj_qkvz.weight" in name:  # per key head [q, k, v, z] -> all q/k/v, all z
        hidden, vz = config["hidden_size"], nv // nk * dv
        per_head = data.T.reshape(hidden, nk, 2 * dk + 2 * vz)
        q, k, v, z = torch.split(per_head, [dk, dk, vz, vz], dim=-1)
        qkv = torch.cat([t.reshape(hidden, -1) for t in (q, k, v)], dim=-1).T
        prefix = name.removesuffix("in_proj_qkvz.weight")
        return [
            (prefix + "in_proj_qkv.weight", qkv),
            (prefix + "in_proj_z.weight", z.reshape(hidden, -1).T),
        ]
    return [(name, data)]


def _mxfp4_ggml(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """Published `[..., G, 16]` codes + `[..., G]` scales -> ggml's `[..., G * 17]` bytes."""
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2)  # 32 codes in order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    joined = torch.cat([scales[..., None], qs], dim=-1)
    return joined.reshape(*joined.shape[:-2], -1).numpy()


def _gpt_oss_tensors(state: dict[str, torch.Tensor]) -> list:
    out: list = []
    for name, data in state.items():
        layer = name.split(".experts.")[0]
        if name.endswith("gate_up_proj_blocks"):
            scales = state[name.replace("_blocks", "_scales")]
            for proj, rows in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                ggml = _mxfp4_ggml(data[:, rows], scales[:, rows])
                out.append((f"{layer}.experts.{proj}.weight", ggml, "MXFP4"))
        elif name.endswith("down_proj_blocks"):
            ggml = _mxfp4_ggml(data, state[name.replace("_blocks", "_scales")])
            out.append((f"{layer}.experts.down_proj.weight", ggml, "MXFP4"))
        elif name.endswith("_scales"):
            continue
        elif name.endswith("gate_up_proj_bias"):
            out.append((f"{layer}.experts.gate_proj.bias", data[..., ::2], None))
            out.append((f"{layer}.experts.up_proj.bias", data[..., 1::2], None))
        elif name.endswith("down_proj_bias"):
            out.append((f"{layer}.experts.down_proj.bias", data, None))
        elif name.endswith("gate_up_proj"):
            t = data.transpose(-1, -2)
            out.append((f"{layer}.experts.gate_proj.weight", t[:, ::2], None))
            out.append((f"{layer}.experts.up_proj.weight", t[:, 1::2], None))
        elif name.endswith("down_proj"):
            out.append((f"{layer}.experts.down_proj.weight", data.transpose(-1, -2), None))
        elif name.endswith(".sinks"):
            out.append((name + ".weight", data, None))
        else:
            out.append((name, data, None))
    return out


def _gguf_name(name_map: Any, name: str) -> str:
    whole = name_map.get_name(name)  # a tensor named without a suffix (ssm_a)
    if whole is not None:
        return whole
    base, _, suffix = name.rpartition(".")
    mapped = name_map.get_name(base)
    assert mapped is not None, f"gguf-py's name map has no {base!r}"
    return f"{mapped}.{suffix}"


def write_hybrid_gguf(hf_dir: str, out_path: str, qtype: Any = None) -> str:
    """Write the checkpoint in `hf_dir` (float, or gpt-oss with MXFP4 experts) to `out_path`;
    matrices in `qtype` (default F32; F16 where rows are not whole blocks, as the converter
    does; 1-D tensors, convs, routers and MXFP4 experts as they are)."""
    import gguf

    qtype = qtype if qtype is not None else gguf.GGMLQuantizationType.F32
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    arch = ARCH_OF[config["model_type"]]
    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_name("tiny")
    _common_metadata(writer, config)
    if arch == "gpt-oss":
        _gpt_oss_metadata(writer, config)
    else:
        _gdn_metadata(writer, config, arch)
    _tokenizer_metadata(writer, hf_dir)
    layers = config["num_hidden_layers"]
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, layers)
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    if arch == "gpt-oss":
        tensors = _gpt_oss_tensors(state)
    else:
        tensors, experts = [], {}
        for name, data in state.items():
            match = EXPERT.match(name)
            if match is not None:  # stacked per layer and projection
                key = f"model.layers.{match[1]}.mlp.experts.{match[3]}.weight"
                experts.setdefault(key, {})[int(match[2])] = data
                continue
            tensors += [(n, d, None) for n, d in _gdn_tensor(name, data, config, arch)]
        for key, per_expert in experts.items():
            tensors.append((key, torch.stack([per_expert[e] for e in sorted(per_expert)]), None))
    for name, data, raw_type in tensors:
        gguf_name = _gguf_name(name_map, name)
        if raw_type == "MXFP4":
            writer.add_tensor(gguf_name, data, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            continue
        values = data.to(torch.float32).contiguous().numpy()
        matrix = values.ndim >= 2 and ".ffn_gate_inp" not in gguf_name and values.shape[-1] > 4
        if matrix and qtype != gguf.GGMLQuantizationType.F32:
            block = gguf.GGML_QUANT_SIZES[qtype][0]
            kind = qtype if values.shape[-1] % block == 0 else gguf.GGMLQuantizationType.F16
            packed = gguf.quants.quantize(values, kind)
            writer.add_tensor(gguf_name, packed, raw_shape=packed.shape, raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
