"""Gemma 2 / Gemma 3 settings from a GGUF file's metadata, read as llama.cpp reads them.

llama.cpp's converter writes Gemma's common keys plus `attention.sliding_window`, the logit
softcaps (`attn_logit_softcapping`, `final_logit_softcapping`) and, for Gemma 3, linear rope
scaling of the global layers. Several settings are not in the file at all: llama.cpp's model
code supplies them, so the same values are used here, or a file that llama.cpp runs one way
would run another way here:

- which layers slide: every other layer from the first (Gemma 2), five of every six (Gemma 3),
  unless the file has `attention.sliding_window_pattern` (a period or one flag per layer);
- the query scale: `attention.scale` when written, else 1 / sqrt(head_dim), except for the
  27B models (told by their layer count), which scale by 1 / sqrt(hidden / heads);
- Gemma 2's softcaps default to 50 (attention) and 30 (final logits) when absent;
- Gemma 3's sliding layers rotate with base `rope.freq_base_swa`, else 10000.

The norm weights are stored plus one (Gemma's norms scale by `1 + w`); `weights.py` takes the
one back off, as transformers' GGUF loader does.
"""

from __future__ import annotations

from typing import Any

GEMMA_ARCHS = ("gemma2", "gemma3")
SLIDING_PERIOD = {"gemma2": 2, "gemma3": 6}
LAYERS_OF_27B = {"gemma2": 46, "gemma3": 62}
GEMMA2_SOFTCAPS = (50.0, 30.0)
LOCAL_ROPE_BASE = 10000.0


def gemma_layer_types(metadata: dict[str, Any], arch: str, num_layers: int) -> list[str]:
    """transformers' `layer_types`: llama.cpp's sliding pattern (a layer `i` slides when
    `i % period < period - 1`), or the file's per-layer flags."""
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", SLIDING_PERIOD[arch])
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(
                f"{arch}.attention.sliding_window_pattern has {len(pattern)} flags for "
                f"{num_layers} layers"
            )
        flags = [bool(p) for p in pattern]
    else:
        period = int(pattern)
        if period < 1:
            raise ValueError(f"{arch}.attention.sliding_window_pattern must be >= 1, got {period}")
        flags = [i % period < period - 1 for i in range(num_layers)]
    return ["sliding_attention" if slides else "full_attention" for slides in flags]


def gemma_kwargs(metadata: dict[str, Any], arch: str, base: dict[str, Any]) -> dict[str, Any]:
    """The Gemma-only config arguments; `base` holds the common ones already read."""
    layers, head_dim = base["num_hidden_layers"], base["head_dim"]
    scale = metadata.get(f"{arch}.attention.scale")
    if scale:
        query_pre_attn_scalar = 1.0 / float(scale) ** 2
    elif layers == LAYERS_OF_27B[arch]:
        query_pre_attn_scalar = base["hidden_size"] / base["num_attention_heads"]
    else:
        query_pre_attn_scalar = head_dim
    attn_cap, final_cap = GEMMA2_SOFTCAPS if arch == "gemma2" else (None, None)
    kwargs: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "attn_logit_softcapping": metadata.get(f"{arch}.attn_logit_softcapping", attn_cap),
        "final_logit_softcapping": metadata.get(f"{arch}.final_logit_softcapping", final_cap),
        "layer_types": gemma_layer_types(metadata, arch, layers),
    }
    window = metadata.get(f"{arch}.attention.sliding_window")
    if window is not None:
        kwargs["sliding_window"] = int(window)
    if arch == "gemma3":
        # transformers 4.x's names; 5.x folds them into `rope_parameters` per layer type
        # (the scaling, as in Gemma 3's checkpoints, for the global layers only).
        local = metadata.get(f"{arch}.rope.freq_base_swa", LOCAL_ROPE_BASE)
        kwargs["rope_local_base_freq"] = float(local)
    return kwargs
