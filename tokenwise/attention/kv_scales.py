"""A checkpoint's fp8 KV-cache scales (`*.k_scale`, `*.v_scale`), onto the attention layers.

Why: checkpoints quantized for an fp8 KV cache (llm-compressor, ModelOpt, AutoFP8) carry one
scale per layer for keys and one for values, calibrated so that `k / k_scale` fits the fp8
range; vLLM reads them, and so does this. They are taken out of the weight stream before the
model sees it (no model has parameters of these names), then set on the layer's impl as Python
floats (`k_scale` / `v_scale`, see `attention/backends/kv_quant.py`). They matter only for an
fp8 cache: with any other cache dtype they are dropped, as in vLLM.

Names: `<attn module>.k_scale` (llm-compressor), `<attn module>.k_proj.k_scale` (ModelOpt),
and the older `<attn module>.kv_scale` (AutoFP8, one scale for both), where the attention
module is the one that holds the tokenwise `Attention` layer (`...self_attn` for
`...self_attn.attn`). A scale whose layer is not in this model (another pipeline stage's) is
ignored.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenwise.attention.layer import Attention

logger = logging.getLogger(__name__)

_SUFFIXES = {
    ".k_scale": ("k_scale",),
    ".v_scale": ("v_scale",),
    ".kv_scale": ("k_scale", "v_scale"),
}
_PROJECTIONS = (".k_proj", ".v_proj", ".qkv_proj")


def take_kv_scales(
    weights: Iterable[tuple[str, torch.Tensor]], found: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights without KV-cache scale tensors, which go into `found` (name -> value)."""
    for name, tensor in weights:
        if any(name.endswith(suffix) for suffix in _SUFFIXES):
            value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else math.nan
            if not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"checkpoint tensor {name} must be one finite scale > 0, got "
                    f"{tensor.numel()} values ({tensor.float().reshape(-1)[:4].tolist()})"
                )
            found[name] = value
        else:
            yield name, tensor


def apply_kv_scales(model: nn.Module, found: dict[str, float], fp8_cache: bool) -> int:
    """Set each scale of `found` on its layer's impl (fp8 caches only); returns how many."""
    if not fp8_cache or not found:
        return 0
    layers = {m.layer_name: m for m in model.modules() if isinstance(m, Attention)}
    applied = 0
    for name, value in found.items():
        suffix = next(s for s in _SUFFIXES if name.endswith(s))
        module = name.removesuffix(suffix)
        for proj in _PROJECTIONS:
            module = module.removesuffix(proj)
        matches = [
            layer
            for layer_name, layer in layers.items()
            if layer_name == module or layer_name.startswith(module + ".")
        ]
        if len(matches) != 1:
            logger.debug(
                "KV scale %s matches %d attention layers here: ignored", name, len(matches)
            )
            continue
        for attr in _SUFFIXES[suffix]:
            setattr(matches[0].impl, attr, value)
        applied += 1
    logger.info("fp8 KV cache: %d k_scale / v_scale tensors from the checkpoint", applied)
    return applied
