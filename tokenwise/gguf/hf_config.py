"""A transformers config rebuilt from a GGUF file's metadata (llama, qwen2, qwen3, gemma2,
gemma3, gemma4, qwen2moe, qwen3moe, the Gated DeltaNet hybrids qwen35 / qwen35moe / qwen3next
and gpt-oss; a llama file with experts is Mixtral).

A GGUF file has no `config.json`: its metadata is the config, under llama.cpp's key names
(`llama.embedding_length`, `qwen3.attention.head_count_kv`, ...). The engine's models read a
transformers config object, so this builds one with `AutoConfig.for_model`, and every model
then runs unchanged. Everything the file states is set explicitly, even where it equals the
config class's default, since those defaults are one checkpoint's values and would silently
apply to another (transformers' own GGUF loader leaves Qwen3's `head_dim` at the class default
of 128, for one).

Unsupported files fail here, before anything is built: an architecture with no entry below,
and rope scaling this reader does not translate.

Llama 3.1+ files carry no rope scaling metadata: llama.cpp's converter turns the checkpoint's
`llama3` scaling into one factor per frequency pair, stored as the `rope_freqs` tensor, and
its rope kernel divides each inverse frequency by its factor. The original parameters cannot
be recovered from the factors, so the config keeps the factors themselves
(`rope_freq_factors`, a tokenwise attribute that `get_rope_config` turns into the
`freq_factors` rope type): the same frequencies llama.cpp computes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenwise.gguf.gemma4_config import gemma4_kwargs
from tokenwise.gguf.gemma_config import gemma_kwargs
from tokenwise.gguf.gpt_oss_config import gpt_oss_kwargs
from tokenwise.gguf.hybrid_config import GDN_ARCHS, decoder_layers, gdn_kwargs
from tokenwise.gguf.moe_config import expert_count, moe_kwargs
from tokenwise.gguf.reader import open_gguf, read_metadata

# llama.cpp architecture -> (transformers model_type, architecture class name).
# Mistral-style files are written as "llama" by llama.cpp, and load as Llama.
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "gemma4": ("gemma4_text", "Gemma4ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
    "qwen3next": ("qwen3_next", "Qwen3NextForCausalLM"),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM"),
}
# llama.cpp writes Mixtral as "llama" with `llama.expert_count` and stacked expert tensors.
MIXTRAL = ("mixtral", "MixtralForCausalLM")


def gguf_architecture(metadata: dict[str, Any], path: str) -> str:
    """The file's `general.architecture`, checked against the ones supported."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise NotImplementedError(
            f"GGUF file {path!r} holds a {arch!r} model; tokenwise loads GGUF files of the "
            f"architectures {', '.join(sorted(ARCHITECTURES))} (llama with experts: Mixtral; "
            "others need a Hugging Face checkpoint directory)"
        )
    return arch


ROPE_FREQS = "rope_freqs.weight"


def _rope_freqs(path: str) -> np.ndarray:
    from gguf.quants import dequantize

    tensor = next(t for t in open_gguf(path).tensors if t.name == ROPE_FREQS)
    return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).ravel()


def _tensor_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in HF order (rows first; GGUF lists the fastest dimension first)."""
    return {t.name: tuple(int(n) for n in reversed(t.shape)) for t in open_gguf(path).tensors}


def _tensor_types(path: str) -> dict[str, str]:
    """Every tensor's GGUF type name (`F32`, `Q8_0`, `MXFP4`, ...)."""
    return {t.name: t.tensor_type.name for t in open_gguf(path).tensors}


def rope_freq_factors(path: str, head_dim: int) -> list[float]:
    """The `rope_freqs` tensor's factors, one per rotated pair (`head_dim / 2` of them)."""
    values = _rope_freqs(path)
    if values.size != head_dim // 2:
        raise ValueError(
            f"GGUF file {path!r}: {ROPE_FREQS} holds {values.size} factors, the rotary head "
            f"of {head_dim} needs {head_dim // 2} (one per frequency pair)"
        )
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise ValueError(f"GGUF file {path!r}: {ROPE_FREQS} holds factors that are not > 0")
    return [float(v) for v in values]


def _rope_scaling(metadata: dict[str, Any], arch: str, names: tuple[str, ...], path: str) -> Any:
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if arch == "gpt-oss":  # YaRN, read by gpt_oss_config
        return None
    if ROPE_FREQS in names and arch != "gemma4":  # gemma4: proportional rope (gemma4_config)
        if arch != "llama" or kind not in (None, "none"):
            raise NotImplementedError(
                f"GGUF file {path!r} has per-frequency rope factors ({ROPE_FREQS}) in a "
                f"{arch!r} model with rope scaling {kind!r}; tokenwise applies them to llama "
                "files without other rope scaling (Llama 3.1+ as llama.cpp converts them)"
            )
        return None
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
    raise NotImplementedError(
        f"GGUF file {path!r} uses rope scaling {kind!r}; only linear scaling is read from "
        "GGUF metadata so far"
    )


def gguf_hf_config(path: str) -> Any:
    """The transformers config of the model in the GGUF file at `path`."""
    from transformers import AutoConfig

    metadata, names = read_metadata(path)
    arch = gguf_architecture(metadata, path)
    model_type, architecture = ARCHITECTURES[arch]
    experts = expert_count(metadata, arch)
    if arch == "llama" and experts > 0:
        model_type, architecture = MIXTRAL

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF file {path!r} lacks the metadata key {arch}.{name}")
        return value

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_size = metadata.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab_size is None:
        raise ValueError(f"GGUF file {path!r} states no vocabulary size and has no token list")
    # head_dim: llama.cpp writes attention.key_length when it differs from hidden / heads
    # (Qwen3), and rope.dimension_count for Llama (the full head is rotated in all three).
    head_dim = metadata.get(f"{arch}.attention.key_length") or metadata.get(
        f"{arch}.rope.dimension_count", hidden // heads
    )
    kwargs: dict[str, Any] = {
        "architectures": [architecture],
        "hidden_size": hidden,
        "intermediate_size": _first(key("feed_forward_length")),
        "num_hidden_layers": decoder_layers(metadata, arch),
        "num_attention_heads": heads,
        "num_key_value_heads": _first(key("attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": int(vocab_size),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    theta = metadata.get(f"{arch}.rope.freq_base")
    if theta is not None:
        kwargs["rope_theta"] = float(theta)
    scaling = _rope_scaling(metadata, arch, names, path)
    if scaling is not None:
        kwargs["rope_scaling"] = scaling
    if ROPE_FREQS in names and arch != "gemma4":
        kwargs["rope_freq_factors"] = rope_freq_factors(path, int(head_dim))
    if model_type in (
        "llama",
        "qwen3",
        "qwen3_moe",
    ):  # Qwen2 always has q/k/v biases; these two may
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
    if model_type == "llama":
        kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in names
    if experts > 0 and arch not in ("gemma4", "gpt-oss"):  # those: their own MoE keys
        kwargs.update(moe_kwargs(metadata, arch, key))
    if arch in ("gemma2", "gemma3"):
        kwargs.update(gemma_kwargs(metadata, arch, kwargs))
    if arch == "gemma4":
        kwargs.pop("rope_theta", None)  # per layer type, in rope_parameters
        factors = _rope_freqs(path) if ROPE_FREQS in names else None
        kwargs.update(gemma4_kwargs(metadata, names, _tensor_shapes(path), factors, kwargs, path))
    if arch in GDN_ARCHS:
        kwargs.update(gdn_kwargs(metadata, arch, kwargs, path))
    if arch == "gpt-oss":
        kwargs.update(gpt_oss_kwargs(metadata, _tensor_types(path), kwargs, path))
    return AutoConfig.for_model(model_type, **kwargs)


def _first(value: Any) -> int:
    """A per-layer array's first value (Gemma 4 writes some keys per layer), else the value."""
    return int(value[0] if isinstance(value, list) else value)
