"""gpt-oss settings from a GGUF file's metadata (llama.cpp's `gpt-oss` architecture).

What the converter writes, and what it leaves to llama.cpp's model code (restated here as
transformers' config, so that the model runs as the checkpoint directory does):
- the experts' count, top-k and width (`expert_count`, `expert_used_count`,
  `expert_feed_forward_length`), the window (`attention.sliding_window`) and YaRN
  (`rope.scaling.*`: factor, original context, beta fast / slow);
- not written: which layers slide (llama.cpp slides every other layer from the first, as
  transformers' default `layer_types` does), the SwiGLU clamp and slope (llama.cpp's fixed
  7.0 and 1.702, the released models' values) and YaRN's `truncate` (False in the released
  config.json, which transformers reads; the file has no key for it);
- MXFP4 experts (tensor type MXFP4): the config then says `quant_method: mxfp4`, so the
  experts keep their 4-bit codes and scales (`gpt_oss_tensors` puts them back in the
  published layout) and the other layers load dense.
"""

from __future__ import annotations

from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702
ARCH = "gpt-oss"


def gpt_oss_kwargs(
    metadata: dict[str, Any], types: dict[str, str], base: dict[str, Any], path: str
) -> dict[str, Any]:
    """The `gpt_oss` config arguments; `types` maps tensor names to GGUF type names."""

    def get(name: str) -> Any:
        value = metadata.get(f"{ARCH}.{name}")
        if value is None:
            raise ValueError(f"GGUF file {path!r} lacks the metadata key {ARCH}.{name}")
        return value

    layers = base["num_hidden_layers"]
    kwargs: dict[str, Any] = {
        "num_local_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "intermediate_size": int(get("expert_feed_forward_length")),
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": [SLIDING if i % 2 == 0 else FULL for i in range(layers)],
        "attention_bias": True,
        "swiglu_limit": SWIGLU_LIMIT,
        "rope_parameters": _yarn(metadata, base, path),
    }
    expert_types = {t for name, t in types.items() if "_exps.weight" in name}
    if "MXFP4" in expert_types:
        if expert_types != {"MXFP4"}:
            raise NotImplementedError(
                f"GGUF file {path!r} mixes MXFP4 experts with {sorted(expert_types - {'MXFP4'})} "
                "ones; tokenwise loads gpt-oss files whose experts are all MXFP4 or none"
            )
        kwargs["quantization_config"] = {"quant_method": "mxfp4"}
    return kwargs


def _yarn(metadata: dict[str, Any], base: dict[str, Any], path: str) -> dict[str, Any]:
    theta = float(base.get("rope_theta", 150000.0))
    kind = metadata.get(f"{ARCH}.rope.scaling.type")
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if kind != "yarn":
        raise NotImplementedError(
            f"GGUF file {path!r}: gpt-oss with rope scaling {kind!r}; only YaRN is read"
        )
    rope: dict[str, Any] = {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": float(metadata[f"{ARCH}.rope.scaling.factor"]),
        "original_max_position_embeddings": int(
            metadata[f"{ARCH}.rope.scaling.original_context_length"]
        ),
        "beta_fast": float(metadata.get(f"{ARCH}.rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(metadata.get(f"{ARCH}.rope.scaling.yarn_beta_slow", 1.0)),
        "truncate": False,
    }
    attn = metadata.get(f"{ARCH}.rope.scaling.yarn_attn_factor")
    if attn is not None:
        rope["attention_factor"] = float(attn)
    return rope
