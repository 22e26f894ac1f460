"""Write a tiny Hugging Face checkpoint as a GGUF file, laid out as llama.cpp's converter does.

Tests need GGUF files without downloading any: this is a small re-statement of what
`convert_hf_to_gguf.py` writes for llama / qwen2 / qwen3 models, with gguf-py's own writer,
name map and (numpy) quantizers:

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
  reference then is transformers reading the same blocks, not the original weights).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

ARCH_OF = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
CONTROL, NORMAL = 3, 1


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
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_vocab_size(config["vocab_size"])
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if head_dim != hidden // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if tokenizer:
        _tokenizer_metadata(writer, hf_dir)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    name_map = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), config["num_hidden_layers"]
    )
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    for hf_name, value in state.items():
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = f"{name_map.get_name(base)}.{suffix}"
        data = value.to(torch.float32).numpy()
        if arch == "llama" and ".attn_q." in gguf_name:
            data = llamacpp_permute(data, heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            data = llamacpp_permute(data, kv_heads)
        if gguf_name in (extra_tensors or {}):
            continue  # replaced below
        override = [t for key, t in (types or {}).items() if key in gguf_name]
        _add(writer, gguf_name, data, override[0] if override else qtype)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)  # as given (an int8 array is written as I8)
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


def _add(writer: Any, name: str, data: np.ndarray, qtype: Any) -> None:
    import gguf

    if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        return
    if qtype.name in K_QUANT_SCALES:
        seed = int.from_bytes(name.encode()[-4:], "little")
        packed = random_k_blocks(data.shape, qtype, seed)
    else:
        packed = gguf.quants.quantize(data, qtype)
    writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
