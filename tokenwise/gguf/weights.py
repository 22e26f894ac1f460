"""A GGUF file's tensors under Hugging Face names, dequantized to the engine's dtype.

Names: gguf-py's `TensorNameMap` maps Hugging Face module names to llama.cpp's
(`model.layers.3.self_attn.q_proj` -> `blk.3.attn_q`). It is many-to-one (it knows several
checkpoint spellings), so it is run forwards over the names the model being loaded asks for
(`expected_names`), and the result inverted. A tensor in the file with no counterpart is an
error, as a missing or unknown tensor is in the safetensors loader.

Permutation: llama.cpp's converter reorders the rows of Llama's q and k projections (each
head's rotary halves interleaved, as its rope kernel wants). `unpermute_qk` undoes that exactly:
per head, rows (2, d/2) were swapped into (d/2, 2); swapping back restores HF's order. Qwen2 and
Qwen3 files are written unpermuted.

Experts: llama.cpp stacks each MoE layer's experts into one 3-D tensor per projection
(`blk.N.ffn_gate_exps` `[E, I, H]`, `ffn_up_exps`, `ffn_down_exps` `[E, H, I]`), which the name
map knows under the stacked HF name (`...block_sparse_moe.experts.w1`). The loader asks for one
tensor per expert (`...experts.3.w1.weight`), so each stacked tensor is yielded expert by
expert, its quantized bytes split the same way (every expert's rows are whole blocks).

Gemma: llama.cpp stores Gemma's norm weights plus one (`gemma_config`); they are read back
minus one, in float32, as transformers' GGUF loader reads them.

Dequantization: `gguf.quants.dequantize` (gguf-py's numpy dequantizers: F32, F16, BF16, Q8_0,
Q4_0/1, Q5_0/1, the K-quants, IQ types, ...) turns each tensor into float32, then it is cast to
the engine's dtype, one tensor at a time. On CPU the linear layers are then quantized again
(`tokenwise.layers.quantization.gguf_layers`), keeping the file's bit widths; on a GPU they stay dense.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from tokenwise.gguf.gdn_tensors import GdnTensors, gdn_tensor_names
from tokenwise.gguf.gemma4_config import gemma4_tensor_names
from tokenwise.gguf.gemma_config import GEMMA_ARCHS
from tokenwise.gguf.gpt_oss_tensors import GptOssTensors, gpt_oss_tensor_names, is_expert_tensor
from tokenwise.gguf.hf_config import gguf_architecture
from tokenwise.gguf.hybrid_config import GDN_ARCHS, decoder_layers
from tokenwise.gguf.mtp_tensors import head_names_as_block, mtp_block, mtp_tensor_names
from tokenwise.gguf.reader import open_gguf, read_metadata

# Tensors that are configuration, not parameters: read by `hf_config` (rope factors).
CONFIG_TENSORS = ("rope_freqs.weight",)
# Architectures whose q/k rows llama.cpp's converter permutes.
PERMUTED_QK = ("llama",)
# An expert's tensor in the checkpoint names the loader asks for: `<layer>.experts.<e>.<proj>`.
EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>[^.]+)$")


def gguf_to_hf_names(arch: str, num_layers: int, expected_names: Iterable[str]) -> dict[str, str]:
    """`{gguf tensor name: HF tensor name}` for the HF names a model expects. A stacked expert
    tensor maps to its per-expert name with `{}` in the expert's place."""
    import gguf

    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, num_layers)
    mapping: dict[str, str] = {}
    for hf_name in expected_names:
        base, _, suffix = hf_name.rpartition(".")
        expert = EXPERT_NAME.match(base)
        if expert is not None:
            stacked = name_map.get_name(f"{expert['prefix']}.{expert['proj']}")
            if stacked is not None:
                mapping[f"{stacked}.{suffix}"] = (
                    f"{expert['prefix']}.{{}}.{expert['proj']}.{suffix}"
                )
            continue
        gguf_base = name_map.get_name(base)
        if gguf_base is not None:
            mapping[f"{gguf_base}.{suffix}"] = hf_name
        elif (whole := name_map.get_name(hf_name)) is not None:
            # A parameter without a `.weight` suffix (Gemma 4's `layer_scalar`): llama.cpp's
            # converter names it with one.
            mapping[f"{whole}.weight"] = hf_name
    return mapping


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (weights and biases alike)."""
    half = weight.shape[0] // num_heads // 2
    # The converter did reshape(h, 2, d/2).swapaxes(1, 2): read as (h, d/2, 2), swap back.
    permuted = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return permuted.swapaxes(1, 2).reshape(weight.shape)


def dequantize_tensor(tensor: Any, path: str) -> np.ndarray:
    """A reader tensor as float32 numpy, in HF's (rows, columns) order."""
    from gguf.quants import dequantize

    try:
        return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    except NotImplementedError as exc:
        raise NotImplementedError(
            f"GGUF tensor {tensor.name!r} in {path!r} has type {tensor.tensor_type.name}, "
            f"which gguf-py cannot dequantize ({exc})"
        ) from exc


def iterate_gguf(
    path: str,
    expected_names: Iterable[str],
    dtype: torch.dtype,
    observe: Callable[[str, torch.Tensor, str, np.ndarray], None] | None = None,
    mtp: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(HF name, tensor in dtype)` for every tensor of the file, one at a time
    (gpt-oss's MXFP4 experts as their uint8 codes and scales, `gpt_oss_tensors`). With `mtp`,
    only the MTP head's tensors of a Gated DeltaNet hybrid, under its `mtp.*` names
    (`mtp_tensors`; `expected_names` are the head's); without, the MTP blocks are skipped.

    `observe(HF name, float32 values, GGUF type name, bytes as [rows, row bytes])` sees each
    tensor before the cast (the
    quantized loader keeps the file's integers from it: `layers.quantization.gguf_layers`)."""
    metadata, _ = read_metadata(path)
    arch = gguf_architecture(metadata, path)
    num_layers = int(metadata[f"{arch}.block_count"])
    heads = int(metadata[f"{arch}.attention.head_count"])
    kv_heads = metadata.get(f"{arch}.attention.head_count_kv", heads)
    kv_heads = int(kv_heads[0] if isinstance(kv_heads, list) else kv_heads)  # per layer: gemma4
    head_block = None
    if mtp:  # the MTP head's tensors only, from the first block after the decoder
        if arch not in GDN_ARCHS:
            raise ValueError(f"GGUF file {path!r}: a {arch} file has no MTP head tokenwise reads")
        first, head_block = decoder_layers(metadata, arch), mtp_block(metadata, arch)
        as_block = head_names_as_block(list(expected_names), first)
        mapping = mtp_tensor_names(gguf_to_hf_names(arch, num_layers, as_block), first)
    else:
        mapping = gguf_to_hf_names(arch, num_layers, expected_names)
    if arch == "gemma4":
        mapping.update(gemma4_tensor_names(num_layers))
    gdn = GdnTensors(metadata, arch) if arch in GDN_ARCHS else None
    if gdn is not None and not mtp:
        mapping.update(gdn_tensor_names(num_layers))
    oss = GptOssTensors() if arch == "gpt-oss" else None
    if oss is not None:
        mapping.update(gpt_oss_tensor_names(num_layers))
    reader = open_gguf(path)
    for tensor in reader.tensors:
        if head_block is not None:  # the MTP head: its block's tensors, nothing else
            if not tensor.name.startswith(head_block):
                continue
        elif tensor.name in CONFIG_TENSORS or (gdn is not None and gdn.is_mtp(tensor.name)):
            continue
        if oss is not None and is_expert_tensor(tensor.name):
            keep_codes = tensor.tensor_type.name == "MXFP4" and tensor.name.endswith("weight")
            values = None if keep_codes else dequantize_tensor(tensor, path)
            for name, out in oss.rewrite(tensor.name, values, tensor.data, tensor.tensor_type.name):
                yield name, out if out.dtype == torch.uint8 else out.to(dtype)
            continue
        hf_name = mapping.get(tensor.name)
        if hf_name is None:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} in {path!r} matches no parameter of the {arch} "
                "model being loaded"
            )
        values = dequantize_tensor(tensor, path)
        raw = tensor.data
        if arch in PERMUTED_QK and ".attn_q." in tensor.name:
            values, raw = unpermute_qk(values, heads), unpermute_qk(raw, heads)
        elif arch in PERMUTED_QK and ".attn_k." in tensor.name:
            values, raw = unpermute_qk(values, kv_heads), unpermute_qk(raw, kv_heads)
        if arch in GEMMA_ARCHS and tensor.name.endswith("norm.weight"):
            values = values - np.float32(1.0)  # stored as 1 + w (see the module docstring)
        if tensor.name.endswith("ffn_gate_inp_shexp.weight") and values.ndim == 1:
            values, raw = values[None], raw[None]  # Qwen2-MoE's shared-expert gate: [1, H]
        part = (hf_name, values, raw, tensor.tensor_type.name)
        rewritten = gdn.rewrite(tensor.name, part) if gdn is not None else [(part, None)]
        for (hf_name, values, raw, qtype), recorded in rewritten:
            yield from _parts(hf_name, values, raw, qtype, dtype, observe, recorded)
    for pending in (gdn, oss):
        if pending is not None:
            pending.finish(path)


def _parts(
    hf_name: str,
    values: np.ndarray,
    raw: np.ndarray,
    qtype: str,
    dtype: torch.dtype,
    observe: Callable[[str, torch.Tensor, str, np.ndarray], None] | None,
    recorded: tuple[np.ndarray, np.ndarray] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """One tensor (a stacked expert tensor: one per expert), observed, in `dtype`.
    `recorded`: (values, raw) to observe instead, in the model's row order (`gdn_tensors`)."""
    if observe is not None and recorded is not None:
        observe(hf_name, torch.from_numpy(np.ascontiguousarray(recorded[0])), qtype, recorded[1])
        observe = None
    if "{}" in hf_name:  # a stacked expert tensor: one expert at a time
        parts = [(hf_name.format(e), values[e], raw[e]) for e in range(values.shape[0])]
    else:
        parts = [(hf_name, values, raw)]
    for name, part, part_raw in parts:
        part = np.ascontiguousarray(part)
        if not part.flags.writeable:  # F32 tensors are views of the read-only file mapping
            part = part.copy()
        tensor_fp32 = torch.from_numpy(part)
        if observe is not None:
            observe(name, tensor_fp32, qtype, part_raw)
        yield name, tensor_fp32.to(dtype)
