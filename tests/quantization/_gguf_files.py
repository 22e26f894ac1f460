"""Write a tiny Hugging Face checkpoint as a GGUF file, laid out as llama.cpp's converter does.

Tests need GGUF files without downloading any: this is a small re-statement of what
`convert_hf_to_gguf.py` writes for llama / qwen2 / qwen3 / gemma2 / gemma3 models and Mixtral
(as "llama" with experts), with gguf-py's own writer, name map and (numpy) quantizers:

- metadata: `general.architecture`, `{arch}.*` hyper-parameters (`context_length`,
  `embedding_length`, `feed_forward_length`, `block_count`, `attention.head_count[_kv]`,
  `attention.key_length` / `value_length`, `rope.freq_base`, `rope.dimension_count`,
  `attention.layer_norm_rms_epsilon`, `vocab_size`) and the tokenizer as `tokenizer.ggml.*`
  (a byte-level BPE: model "gpt2", tokens, token types, merges, BOS/EOS ids) plus
  `tokenizer.chat_template`;
- tensors under llama.cpp's names (`blk.N.attn_q.weight`, ...), with Llama's q/k rows
  permuted as llama.cpp's converter permutes them (written here from its description, so the
  loader's inverse is checked against an independent statement of it); 1-D tensors stay F32 as
  llama.cpp keeps them, matrices get `qtype`; `output.weight` only when not tied. gguf-py has
  no numpy quantizer for the K-quants, so those matrices get random valid blocks instead (the
  reference then is transformers reading the same blocks, not the original weights);
- Gemma: `attention.sliding_window`, the softcaps, `key_length` always, Gemma 3's global rope
  base, linear scaling and local base (`rope.freq_base_swa`), and every norm weight plus one;
- MoE (Mixtral, Qwen2-MoE, Qwen3-MoE): `expert_count`, `expert_used_count`, the experts'
  widths (`expert_feed_forward_length`, `expert_shared_feed_forward_length`), each layer's experts stacked per projection
  into `ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps` `[E, rows, cols]`; the router
  (`ffn_gate_inp`, and Qwen2-MoE's shared-expert gate `ffn_gate_inp_shexp`, one row) stays
  F32, as llama-quantize leaves it.

`dense_dir` also writes the checkpoint as the file stores it (every tensor dequantized, norms
without the one): the reference for architectures transformers' GGUF loader cannot read.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

ARCH_OF = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma4_text": "gemma4",
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
}
EXPERT = re.compile(
    r"^(?P<layer>.*\.experts)\.(?P<e>\d+)\.(?P<proj>w[123]|gate_proj|up_proj|down_proj)\.weight$"
)
CONTROL, NORMAL = 3, 1
GEMMA4_ROUTER_SCALES = re.compile(r"^model\.layers\.(\d+)\.router\.(scale|per_expert_scale)$")
GEMMA4_ROUTER_SCALES_AS = {"scale": "ffn_gate_inp", "per_expert_scale": "ffn_down_exps"}


def llamacpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama's q/k rows: per head, the rotary halves
    (2, d/2) are interleaved into (d/2, 2)."""
    rows = weight.shape[0]
    shaped = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return shaped.swapaxes(1, 2).reshape(weight.shape)


def _tokenizer_metadata(writer: Any, hf_dir: str) -> None:
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        spec = json.load(f)
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    special = {added["content"] for added in spec.get("added_tokens", []) if added["special"]}
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids have gaps"
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
        tok_config = json.load(f)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if t in special else NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[tok_config["bos_token"]])
    writer.add_eos_token_id(vocab[tok_config["eos_token"]])


def llama3_rope_factors(config: dict[str, Any], head_dim: int) -> np.ndarray | None:
    """What llama.cpp's converter writes as `rope_freqs` for `llama3` rope scaling: one
    divisor per frequency pair (1 for wavelengths under `original / high_freq_factor`,
    `factor` over `original / low_freq_factor`, the reciprocal of the linear blend of `1 /
    factor` and 1 between). Like the converter, the original context is the config's
    top-level `original_max_position_embeddings`, 8192 when absent (the rope dict's own
    value is not read: Llama 3.x checkpoints say 8192 in both places)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type") != "llama3":
        return None
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    original = float(config.get("original_max_position_embeddings", 8192))
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    wavelengths = 2 * np.pi * np.float32(theta) ** exponents
    out = np.empty(len(wavelengths), dtype=np.float32)
    for i, wavelength in enumerate(wavelengths.astype(np.float64)):
        if wavelength < original / high:
            out[i] = 1.0
        elif wavelength > original / low:
            out[i] = factor
        else:
            blend = (original / wavelength - low) / (high - low)
            out[i] = 1.0 / ((1.0 - blend) / factor + blend)
    return out


def gemma4_shape(config: dict[str, Any]) -> tuple[int, int | None]:
    """(global_head_dim, num_global_key_value_heads) as the hub's config.json states them;
    transformers 5 saves them per layer (`per_layer_config`) instead."""
    per_layer = config.get("per_layer_config") or {}
    first = per_layer[min(per_layer, key=int)] if per_layer else {}
    global_dim = config.get("global_head_dim") or first.get("head_dim") or config["head_dim"]
    global_kv = config.get("num_global_key_value_heads") or first.get("num_key_value_heads")
    return int(global_dim), (None if global_kv is None else int(global_kv))


def _gemma4_metadata(writer: Any, config: dict[str, Any]) -> None:
    """What llama.cpp's converter adds for Gemma 4 over Gemma 3's keys: per-layer sliding
    flags, the global layers' head size as `key_length` (overwriting Gemma 3's; the sliding
    one as `*_swa`), their KV heads and (double-wide) MLP widths as per-layer arrays, KV
    sharing, the per-layer embedding width; norms are stored as they are (no plus one). The
    rope bases (global, `freq_base_swa`) and the final soft-cap are Gemma 3's keys."""
    layers, types = config["num_hidden_layers"], config["layer_types"]
    swa = [t == "sliding_attention" for t in types]
    global_dim, global_kv = gemma4_shape(config)
    shared = int(config.get("num_kv_shared_layers") or 0)
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(config.get("hidden_size_per_layer_input") or 0)
    writer.add_sliding_window_pattern(swa)
    writer.add_key_length(global_dim)
    writer.add_value_length(global_dim)
    writer.add_key_length_swa(config["head_dim"])
    writer.add_value_length_swa(config["head_dim"])
    if config.get("use_double_wide_mlp"):
        ff = config["intermediate_size"]
        writer.add_feed_forward_length(
            [ff if i < layers - shared else 2 * ff for i in range(layers)]
        )
    if global_kv is not None and config.get("attention_k_eq_v"):
        kv = config["num_key_value_heads"]
        writer.add_head_count_kv([kv if s else global_kv for s in swa])
    writer.add_rope_dimension_count(global_dim)
    writer.add_rope_dimension_count_swa(config["head_dim"])


def gemma4_rope_factors(config: dict[str, Any]) -> np.ndarray:
    """The converter's `rope_freqs` for Gemma 4's global layers: proportional rope written as
    factor 1 for the rotated pairs and 1e30 (frequency ~0: not rotated) for the rest."""
    global_dim, _ = gemma4_shape(config)
    partial = float(config["rope_parameters"]["full_attention"]["partial_rotary_factor"])
    rotated = int(global_dim * partial / 2)
    return np.array([1.0] * rotated + [1e30] * (global_dim // 2 - rotated), dtype=np.float32)


def write_gguf(
    hf_dir: str,
    out_path: str,
    qtype: Any = None,
    *,
    chat_template: str | None = None,
    tokenizer: bool = True,
    architecture: str | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    types: dict[str, Any] | None = None,
    dense_dir: str | None = None,
) -> str:
    """Write the checkpoint in `hf_dir` to `out_path`; matrices in `qtype` (default F32).

    `types` maps parts of GGUF tensor names to other types for those tensors (a mixed file,
    as `llama-quantize`'s Q4_K_M writes: `{"attn_v": Q6_K, "ffn_down": Q6_K}`).
    `extra_tensors` are written as given, replacing the checkpoint's tensor of the same name."""
    import gguf

    qtype = qtype if qtype is not None else gguf.GGMLQuantizationType.F32
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    arch = architecture or ARCH_OF[config["model_type"]]
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_name("tiny")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope:  # Gemma 3 (transformers 5): global and local parameters
        local, rope = rope["sliding_attention"], rope["full_attention"]
        writer.add_rope_freq_base_swa(float(local["rope_theta"]))
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_vocab_size(config["vocab_size"])
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if head_dim != hidden // heads or arch.startswith("gemma"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch.startswith("gemma"):
        writer.add_sliding_window(config["sliding_window"])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if config.get(key) is not None:
                getattr(writer, f"add_{key}")(float(config[key]))
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.get("num_experts_per_tok") or config["top_k_experts"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if arch == "gemma4":
        _gemma4_metadata(writer, config)
    if tokenizer:
        _tokenizer_metadata(writer, hf_dir)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    name_map = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), config["num_hidden_layers"]
    )
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    stored: dict[str, torch.Tensor] = {}
    for hf_names, gguf_name, data in _llamacpp_tensors(state, name_map):
        if arch in ("gemma2", "gemma3") and gguf_name.endswith("norm.weight"):
            data = data + np.float32(1.0)
        if arch == "llama" and ".attn_q." in gguf_name:
            data = llamacpp_permute(data, heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            data = llamacpp_permute(data, kv_heads)
        if gguf_name in (extra_tensors or {}):
            continue  # replaced below
        override = [t for key, t in (types or {}).items() if key in gguf_name]
        if ".ffn_gate_inp" in gguf_name:  # routers (and Qwen2-MoE's shared-expert gate)
            override = [gguf.GGMLQuantizationType.F32]
        if ".ffn_gate_inp_shexp." in gguf_name:  # [1, H] in HF, one row in the file
            data = data.reshape(-1)
        values = _add(writer, gguf_name, data, override[0] if override else qtype)
        if arch in ("gemma2", "gemma3") and gguf_name.endswith("norm.weight"):
            values = values - np.float32(1.0)
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            values = _unpermute(values, heads, kv_heads, gguf_name)
        if EXPERT.match(hf_names[0]) is None:
            values = values.reshape(state[hf_names[0]].shape)
            stored[hf_names[0]] = torch.from_numpy(np.ascontiguousarray(values))
        else:  # a stacked expert tensor: back to one tensor per expert
            for expert, hf_name in enumerate(hf_names):
                stored[hf_name] = torch.from_numpy(np.ascontiguousarray(values[expert]))
    factors = llama3_rope_factors(config, head_dim) if arch == "llama" else None
    if arch == "gemma4":
        factors = gemma4_rope_factors(config)
    if factors is not None and "rope_freqs.weight" not in (extra_tensors or {}):
        writer.add_tensor("rope_freqs.weight", factors)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)  # as given (an int8 array is written as I8)
    if dense_dir is not None:
        _write_dense(hf_dir, dense_dir, state, stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


# K-quants gguf-py can dequantize but not quantize: byte offsets of each block's fp16 scales
# (Q4_K / Q5_K: d and dmin first; Q6_K: d last) and a value for them, so that random blocks
# decode to weights of at most ~0.1-0.2 (Q4_K: d * 63 * 15 - dmin * 63; Q6_K: d * 128 * 32).
K_QUANT_SCALES = {"Q4_K": ((0, 2), 1e-4), "Q5_K": ((0, 2), 5e-5), "Q6_K": ((-2,), 2e-5)}


def random_k_blocks(shape: tuple[int, ...], qtype: Any, seed: int) -> np.ndarray:
    """Random but valid blocks of a K-quant type for a (rows, cols) matrix: random quants and
    sub-block scales, block scales from `K_QUANT_SCALES` (values of trained weights' size)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    assert cols % block == 0, f"{qtype.name} needs rows of a multiple of {block} values"
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    offsets, value = K_QUANT_SCALES[qtype.name]
    scale = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    for offset in offsets:
        start = offset % size
        blocks[:, :, start : start + 2] = scale
    return blocks.reshape(rows, -1)


def _llamacpp_tensors(
    state: dict[str, torch.Tensor], name_map: Any
) -> list[tuple[list[str], str, np.ndarray]]:
    """`(HF names, GGUF name, float32 values)` in llama.cpp's layout: one tensor per HF tensor,
    but each layer's experts stacked per projection (HF names in expert order)."""
    out: list[tuple[list[str], str, np.ndarray]] = []
    stacks: dict[str, dict[int, tuple[str, np.ndarray]]] = {}
    for hf_name, value in state.items():
        data = value.to(torch.float32).numpy()
        expert = EXPERT.match(hf_name)
        if expert is not None:
            stacked = f"{name_map.get_name(expert['layer'] + '.' + expert['proj'])}.weight"
            stacks.setdefault(stacked, {})[int(expert["e"])] = (hf_name, data)
            continue
        router = GEMMA4_ROUTER_SCALES.match(hf_name)
        if router is not None:  # Gemma 4: stored beside the router and the down experts
            layer, which = router.groups()
            out.append(([hf_name], f"blk.{layer}.{GEMMA4_ROUTER_SCALES_AS[which]}.scale", data))
            continue
        if hf_name.endswith((".layer_scalar", ".experts.gate_up_proj", ".experts.down_proj")):
            hf_name_base, suffix = hf_name, "weight"  # Gemma 4: the converter appends it
        else:
            hf_name_base, _, suffix = hf_name.rpartition(".")
        out.append(([hf_name], f"{name_map.get_name(hf_name_base)}.{suffix}", data))
    for gguf_name, experts in stacks.items():
        ordered = [experts[e] for e in sorted(experts)]
        out.append(([n for n, _ in ordered], gguf_name, np.stack([d for _, d in ordered])))
    return out


def _unpermute(values: np.ndarray, heads: int, kv_heads: int, gguf_name: str) -> np.ndarray:
    n = heads if ".attn_q." in gguf_name else kv_heads
    half = values.shape[0] // n // 2
    return values.reshape(n, half, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)


def _write_dense(hf_dir: str, dense_dir: str, state: dict, stored: dict) -> None:
    from safetensors.torch import save_file

    assert set(stored) == set(state), "every checkpoint tensor is stored once"
    os.makedirs(dense_dir, exist_ok=True)
    for name in os.listdir(hf_dir):
        if name != "model.safetensors":
            shutil.copy(os.path.join(hf_dir, name), dense_dir)
    save_file(stored, os.path.join(dense_dir, "model.safetensors"), metadata={"format": "pt"})


def _add(writer: Any, name: str, data: np.ndarray, qtype: Any) -> np.ndarray:
    """Write one tensor; returns the float32 values the file holds for it."""
    import gguf

    if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        return data
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if data.shape[-1] % block:  # rows the type cannot hold: F16, as llama.cpp's converter does
        qtype = gguf.GGMLQuantizationType.F16
    if qtype.name in K_QUANT_SCALES:
        seed = int.from_bytes(name.encode()[-4:], "little")
        rows = data.reshape(-1, data.shape[-1])
        packed = random_k_blocks(rows.shape, qtype, seed).reshape(*data.shape[:-1], -1)
    else:
        packed = gguf.quants.quantize(data, qtype)
    writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
    return np.asarray(gguf.quants.dequantize(packed, qtype), dtype=np.float32)
