"""gpt-oss's expert tensors in a GGUF file, back in the published checkpoint's layout.

llama.cpp's converter splits each layer's `gate_up_proj` (gate and up rows interleaved) into
`ffn_gate_exps` and `ffn_up_exps` (and its bias likewise), and stores the experts `[E, rows,
cols]` where transformers' dense checkpoint has them transposed. This module joins them again:
a layer's gate and up wait for each other (`GptOssTensors.rewrite`), then yield one
interleaved tensor, as the checkpoint directory holds it.

MXFP4 experts stay 4-bit. A GGUF MXFP4 block is 17 bytes for 32 values: the e8m0 scale byte,
then 16 bytes whose low nibbles are values 0-15 and high nibbles values 16-31. The published
layout (`layers.quantization.mxfp4`) keeps the scale apart (`*_scales [E, rows, G]`) and packs
values 2j and 2j+1 into byte j (`*_blocks [E, rows, G, 16]`). The scale byte means the same in
both (ggml doubles the e2m1 magnitudes and halves the scale), so only the nibbles move: the
codes are unpacked and packed again, exactly, and never dequantized (a 20B model's experts
would not fit in float32).
"""

from __future__ import annotations

import re

import numpy as np
import torch

EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)$")
MXFP4_BLOCK = 17  # bytes: one scale, 16 of codes
GROUP = 32


def gpt_oss_tensor_names(num_layers: int) -> dict[str, str]:
    """GGUF -> HF names of the attention sinks and the router (gguf-py's map does not give
    them back under the published names)."""
    names: dict[str, str] = {}
    for i in range(num_layers):
        names[f"blk.{i}.attn_sinks.weight"] = f"model.layers.{i}.self_attn.sinks"
        names[f"blk.{i}.ffn_gate_inp.weight"] = f"model.layers.{i}.mlp.router.weight"
        names[f"blk.{i}.ffn_gate_inp.bias"] = f"model.layers.{i}.mlp.router.bias"
    return names


def is_expert_tensor(gguf_name: str) -> bool:
    return EXPERTS.match(gguf_name) is not None


def mxfp4_to_published(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF MXFP4 bytes `[..., rows, G * 17]` -> published `(blocks [..., rows, G, 16],
    scales [..., rows, G])`."""
    if raw.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 rows must be whole 17-byte blocks, got {raw.shape[-1]} bytes")
    blocks = raw.reshape(*raw.shape[:-1], raw.shape[-1] // MXFP4_BLOCK, MXFP4_BLOCK)
    scales, qs = blocks[..., 0], blocks[..., 1:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1)  # the 32 codes in order
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(packed, dtype=np.uint8), np.ascontiguousarray(scales)


class GptOssTensors:
    """Joins each layer's expert tensors into the published ones."""

    def __init__(self) -> None:
        self.waiting: dict[tuple[int, str], dict[str, np.ndarray]] = {}

    def rewrite(
        self, gguf_name: str, values: np.ndarray | None, raw: np.ndarray, qtype: str
    ) -> list[tuple[str, torch.Tensor]]:
        """`(HF name, tensor)` pairs ready for the model (float32, or uint8 MXFP4 codes);
        `values` is None for an MXFP4 tensor (not dequantized)."""
        match = EXPERTS.match(gguf_name)
        assert match is not None, gguf_name
        layer, proj, kind = int(match[1]), match[2], match[3]
        prefix = f"model.layers.{layer}.mlp.experts"
        mxfp4 = qtype == "MXFP4"
        if kind == "weight" and mxfp4:
            data = raw
        else:
            assert values is not None
            data = values
        if proj == "down":
            return self._down(prefix, kind, data, mxfp4 and kind == "weight")
        held = self.waiting.setdefault((layer, kind), {})
        held[proj] = data
        if len(held) < 2:
            return []
        del self.waiting[(layer, kind)]
        gate, up = held["gate"], held["up"]
        if kind == "bias":  # [E, I] each -> [E, 2I], interleaved
            return [(f"{prefix}.gate_up_proj_bias", _tensor(_interleave(gate, up, -1)))]
        if gate.dtype == np.uint8:  # MXFP4 rows [E, I, G*17] -> interleaved rows
            (gb, gs), (ub, us) = mxfp4_to_published(gate), mxfp4_to_published(up)
            return [
                (f"{prefix}.gate_up_proj_blocks", _tensor(_interleave(gb, ub, 1))),
                (f"{prefix}.gate_up_proj_scales", _tensor(_interleave(gs, us, 1))),
            ]
        # dense [E, I, H] each -> the checkpoint's [E, H, 2I]
        joined = _interleave(gate.transpose(0, 2, 1), up.transpose(0, 2, 1), -1)
        return [(f"{prefix}.gate_up_proj", _tensor(joined))]

    def _down(
        self, prefix: str, kind: str, data: np.ndarray, mxfp4: bool
    ) -> list[tuple[str, torch.Tensor]]:
        if kind == "bias":
            return [(f"{prefix}.down_proj_bias", _tensor(data))]
        if mxfp4:
            blocks, scales = mxfp4_to_published(data)
            return [
                (f"{prefix}.down_proj_blocks", _tensor(blocks)),
                (f"{prefix}.down_proj_scales", _tensor(scales)),
            ]
        return [(f"{prefix}.down_proj", _tensor(data.transpose(0, 2, 1)))]  # [E, I, H]

    def finish(self, path: str) -> None:
        if self.waiting:
            (layer, kind), held = next(iter(self.waiting.items()))
            raise ValueError(
                f"GGUF file {path!r}: layer {layer} has the experts' {'/'.join(held)} {kind} "
                "but not both of ffn_gate_exps / ffn_up_exps"
            )


def _interleave(a: np.ndarray, b: np.ndarray, axis: int) -> np.ndarray:
    """`a` and `b` alternating along `axis` (a first), as gpt-oss stores gate and up."""
    stacked = np.stack([a, b], axis=axis + 1 if axis >= 0 else axis)
    shape = list(a.shape)
    shape[axis] *= 2
    return stacked.reshape(shape)


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array).copy())
