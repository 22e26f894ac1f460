"""The linear-attention tensors of a Gated DeltaNet GGUF file, back in the checkpoint's layout.

llama.cpp's converter rewrites these tensors for its own graph; each step is undone here so
the model loads them as it loads the Hugging Face checkpoint (names: `gdn_tensor_names`):
- `A_log` is stored as `ssm_a = -exp(A_log)`: read back as `log(-ssm_a)` (float32 rounding:
  one ulp of A_log, far below the 1e-4 logit bar);
- `dt_bias` is `ssm_dt.bias`; the conv weight `[C, 1, K]` is squeezed to `[C, K]`;
- every RMSNorm weight but the gated one (`ssm_norm`) is stored as `1 + w` (Qwen3-Next's norms
  are zero-centred): read back minus one;
- Qwen3-Next's `in_proj_qkvz` (per key head: q, k, v, z) is split into `attn_qkv` (all q,
  all k, all v) and `attn_gate` (all z); both are regrouped per key head into one tensor
  again (`in_proj_ba` is stored as it is, as `ssm_ba`). The model's fused `in_proj` holds
  them un-grouped (all q, k, v, z, b, a), the order in which the quantized layers join their
  parts' records, so those see the file's own order (all q/k/v then z; all b then a);
- Qwen3.5 with fewer key than value heads: the converter reorders the value heads from
  grouped by key head (`k0v0 k0v1 k1v0 k1v1`) to tiled (`k0v0 k1v0 k0v1 k1v1`) in every tensor
  indexed by value head (v rows of `attn_qkv` and of the conv, `attn_gate`, `ssm_alpha` /
  `ssm_beta` rows, `ssm_a`, `ssm_dt`, `ssm_out`'s columns); the inverse permutation is applied.
The file's quantized bytes (`raw`, kept by the GGUF quantized layers) follow the rows. For
`ssm_out`'s columns they follow whole blocks when a value head spans whole blocks; otherwise
(a K-quant's 256-value block across 128-wide heads) that one layer is loaded dense, since its
blocks mix heads that move apart.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenwise.gguf.hybrid_config import decoder_layers

Part = tuple[str, np.ndarray, np.ndarray, str]  # (HF name, float32 values, raw bytes, type)
# A rewritten tensor: its part, and the rows the quantized layers record when they differ
# (Qwen3-Next's in_proj: see `_qkvz`), as (values, raw) in the model's row order.
Rewritten = tuple[Part, tuple[np.ndarray, np.ndarray] | None]
FLOAT_TYPES = ("F32", "F16", "BF16")

# GGUF tensor of a linear-attention layer -> the HF parameter (relative to `linear_attn`).
_LINEAR = {
    "ssm_a": "A_log",
    "ssm_dt.bias": "dt_bias",
    "ssm_conv1d.weight": "conv1d.weight",
    "ssm_norm.weight": "norm.weight",
    "ssm_out.weight": "out_proj.weight",
    "ssm_alpha.weight": "in_proj_a.weight",
    "ssm_beta.weight": "in_proj_b.weight",
    "ssm_ba.weight": "in_proj_ba.weight",
    "attn_qkv.weight": "in_proj_qkv.weight",
    "attn_gate.weight": "in_proj_z.weight",
}
QKVZ = "in_proj_qkvz.weight"


def gdn_tensor_names(num_layers: int) -> dict[str, str]:
    """GGUF -> HF names of the linear-attention tensors (gguf-py's map has no HF names for
    Qwen3.5's split projections or the renamed `A_log` / `dt_bias`)."""
    return {
        f"blk.{i}.{gguf_name}": f"model.layers.{i}.linear_attn.{hf_name}"
        for i in range(num_layers)
        for gguf_name, hf_name in _LINEAR.items()
    }


def _grouped_order(nk: int, per_k: int, width: int) -> np.ndarray:
    """Row indices that take tiled value heads back to grouped ones (`width` rows a head)."""
    tiled = np.arange(nk * per_k * width).reshape(per_k, nk, width)
    return tiled.transpose(1, 0, 2).reshape(-1)


class GdnTensors:
    """Rewrites one hybrid file's tensors (`rewrite`), holding Qwen3-Next's q/k/v until its z
    arrives (`finish` checks that nothing is left waiting)."""

    def __init__(self, metadata: dict[str, Any], arch: str) -> None:
        self.arch = arch
        self.nk = int(metadata[f"{arch}.ssm.group_count"])
        self.nv = int(metadata[f"{arch}.ssm.time_step_rank"])
        self.dk = int(metadata[f"{arch}.ssm.state_size"])
        self.dv = int(metadata[f"{arch}.ssm.inner_size"]) // self.nv
        self.layers = decoder_layers(metadata, arch)
        # Only Qwen3.5's converter reorders value heads (Qwen3-Next's keeps them grouped).
        self.tiled = arch != "qwen3next" and self.nk != self.nv
        self.waiting: dict[str, dict[str, Part]] = {}

    def is_mtp(self, gguf_name: str) -> bool:
        """A tensor of the MTP blocks after the decoder (skipped, as `mtp.*` tensors are)."""
        parts = gguf_name.split(".")
        return parts[0] == "blk" and int(parts[1]) >= self.layers

    def rewrite(self, gguf_name: str, part: Part) -> list[Rewritten]:
        name, values, raw, qtype = part
        if gguf_name.endswith("norm.weight") and not gguf_name.endswith("ssm_norm.weight"):
            return [((name, values - np.float32(1.0), raw, qtype), None)]
        kind = gguf_name.split(".", 2)[-1]
        if kind not in _LINEAR:
            return [(part, None)]
        if kind == "ssm_a":
            values = np.log(-values.astype(np.float64)).astype(np.float32)
            raw = values
        elif kind == "ssm_conv1d.weight":
            values, raw = values[:, None, :], raw[:, None, :]
        if self.tiled and kind not in ("ssm_norm.weight", "ssm_ba.weight"):  # not per head
            values, raw, qtype = self._untile(kind, values, raw, qtype)
        if self.arch == "qwen3next" and kind in ("attn_qkv.weight", "attn_gate.weight"):
            return self._qkvz(name, kind, (name, values, raw, qtype))
        if kind == "ssm_ba.weight":  # per key head [b, a] -> all b, all a for the records
            ratio = self.nv // self.nk
            grouped = np.arange(2 * self.nv).reshape(self.nk, 2, ratio)
            order = grouped.transpose(1, 0, 2).reshape(-1)
            return [((name, values, raw, qtype), (values[order], raw[order]))]
        return [((name, values, raw, qtype), None)]

    def _untile(
        self, kind: str, values: np.ndarray, raw: np.ndarray, qtype: str
    ) -> tuple[np.ndarray, np.ndarray, str]:
        per_k = self.nv // self.nk
        head = (
            1
            if kind in ("ssm_a", "ssm_dt.bias", "ssm_alpha.weight", "ssm_beta.weight")
            else self.dv
        )
        order = _grouped_order(self.nk, per_k, head)
        if kind in ("attn_qkv.weight", "ssm_conv1d.weight"):  # only the v rows moved
            qk = 2 * self.nk * self.dk
            order = np.concatenate([np.arange(qk), qk + order])
        if kind == "ssm_out.weight":  # columns
            values = values[:, order]
            if qtype in FLOAT_TYPES:
                return values, raw[:, order], qtype
            import gguf

            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
            if self.dv % block:
                return values, values, "F32"  # blocks span heads that move: load it dense
            blocks = _grouped_order(self.nk, per_k, self.dv // block)
            return values, raw.reshape(raw.shape[0], -1, size)[:, blocks].reshape(raw.shape), qtype
        return values[order], raw[order], qtype

    def _qkvz(self, name: str, kind: str, part: Part) -> list[Rewritten]:
        layer = name.rsplit(".linear_attn.", 1)[0]
        held = self.waiting.setdefault(layer, {})
        held[kind] = part
        if len(held) < 2:
            return []
        del self.waiting[layer]
        _, qkv, qkv_raw, qkv_type = held["attn_qkv.weight"]
        _, z, z_raw, z_type = held["attn_gate.weight"]
        nk, dk, vz = self.nk, self.dk, self.nv // self.nk * self.dv
        rows = []
        for g in range(nk):  # per key head: q, k, v, z (z rows follow qkv's)
            rows += [np.arange(g * dk, (g + 1) * dk), nk * dk + np.arange(g * dk, (g + 1) * dk)]
            rows += [2 * nk * dk + np.arange(g * vz, (g + 1) * vz)]
            rows += [qkv.shape[0] + np.arange(g * vz, (g + 1) * vz)]
        order = np.concatenate(rows)
        flat = np.concatenate([qkv, z])
        hf_name = f"{layer}.linear_attn.{QKVZ}"
        if qkv_type != z_type:  # rows of two formats cannot be one tensor's bytes
            return [((hf_name, flat[order], flat[order], "F32"), None)]
        flat_raw = np.concatenate([qkv_raw, z_raw])
        return [((hf_name, flat[order], flat_raw[order], qkv_type), (flat, flat_raw))]

    def finish(self, path: str) -> None:
        if self.waiting:
            layer, held = next(iter(self.waiting.items()))
            raise ValueError(
                f"GGUF file {path!r}: {layer} has {', '.join(held)} but not both of "
                "attn_qkv / attn_gate (Qwen3-Next's in_proj_qkvz)"
            )
