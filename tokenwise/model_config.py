"""Model settings resolved from a local Hugging Face checkpoint directory or a GGUF file.

transformers 4.x and 5.x write `config.json` differently (`torch_dtype` vs `dtype`,
`rope_theta`/`rope_scaling` vs `rope_parameters`); the accessors here accept both so that model
code never has to care which version saved the checkpoint.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenwise.config import PoolerConfig
from tokenwise.gguf.hf_config import gguf_hf_config
from tokenwise.gguf.reader import is_gguf_path
from tokenwise.gguf.tokenizer import prepare_tokenizer
from tokenwise.quantization_config import resolve_quantization

logger = logging.getLogger(__name__)

# What an engine does with its model: "generate" text, or pool hidden states: "embed" them, or
# put them through a classification head to "score" text pairs or "classify" texts (vLLM's names).
TASKS = ("generate", "embed", "score", "classify")
POOLING_TASKS = ("embed", "score", "classify")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


# CPU flags (Linux /proc/cpuinfo names) of native bf16 matrix instructions.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def _cpu_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def cpu_flag_summary() -> str:
    """The CPU's vector flags that decide matmul speed (AVX2, AVX-512 and its bf16/VNNI parts,
    AMX), for printing beside every CPU figure."""
    flags = _cpu_flags() or set()
    wanted = sorted(f for f in flags if f == "avx2" or f.startswith(("avx512", "amx")))
    return " ".join(wanted) or "no AVX2"


def cpu_supports_bf16() -> bool:
    """True when this CPU computes bf16 matmuls natively (AVX512_BF16 or AMX).

    Not oneDNN's own check: it also says yes on AVX-512 CPUs without bf16 instructions, where
    bf16 is emulated and measured slower than fp32, which is the trap `dtype="auto"` must avoid.
    """
    flags = _cpu_flags()
    if flags is not None:
        return any(flag in flags for flag in NATIVE_BF16_FLAGS)
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


def checkpoint_dtype(hf_config: Any) -> torch.dtype | None:
    """The dtype the checkpoint was saved in (`dtype` in 5.x, `torch_dtype` in 4.x)."""
    for name in ("dtype", "torch_dtype"):
        value = getattr(hf_config, name, None)
        if value is None:
            continue
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and value.replace("torch.", "") in _DTYPES:
            return _DTYPES[value.replace("torch.", "")]
    return None


def resolve_dtype(dtype: str | torch.dtype, hf_config: Any, device: str) -> torch.dtype:
    """ "auto": the checkpoint's dtype on GPU; on CPU bf16 where supported, else fp32."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    key = str(dtype).lower().replace("torch.", "")
    if key == "auto":
        if device.startswith("cuda"):
            saved = checkpoint_dtype(hf_config)
            return saved if saved in (torch.float16, torch.bfloat16) else torch.bfloat16
        if cpu_supports_bf16():
            return torch.bfloat16
        logger.info(
            "dtype auto -> float32: this CPU has no native bf16 (no %s flag), where bf16 is "
            "emulated and slower; pass dtype='bfloat16' to use it anyway",
            " / ".join(NATIVE_BF16_FLAGS),
        )
        return torch.float32
    if key not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16, got {dtype!r}")
    return _DTYPES[key]


# Models whose position ids start after the padding index: the table's first
# `pad_token_id + 1` rows are never a real position (XLM-RoBERTa: 514 rows, 512 tokens).
_OFFSET_POSITION_MODELS = ("roberta", "xlm-roberta")


def max_position_embeddings(hf_config: Any) -> int | None:
    # `max_target_positions`: the decoder of an encoder-decoder model (Whisper).
    names = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
    for name in (*names, "max_target_positions"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            if getattr(hf_config, "model_type", None) in _OFFSET_POSITION_MODELS:
                value -= int(getattr(hf_config, "pad_token_id", None) or 0) + 1
            return value
    return None


def _read_hf_config(model: str) -> Any:
    from transformers import AutoConfig

    if not os.path.isdir(model):
        raise FileNotFoundError(
            f"model directory {model!r} does not exist (tokenwise loads local Hugging Face "
            "checkpoint directories and GGUF files)"
        )
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise FileNotFoundError(f"model directory {model!r} has no config.json")
    return AutoConfig.from_pretrained(model, local_files_only=True)


@dataclass
class ModelConfig:
    """What the engine needs to know about the model it serves."""

    model: str
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    load_format: str = "auto"
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    architectures: list[str] = field(default_factory=list)
    task: str = "generate"
    # The resolved pooling of an "embed" model (None for generative ones).
    pooler_config: PoolerConfig | None = None
    # How linear layers are quantized: a `layers.quantization.registry` name; None: dense.
    quantization: str | None = None
    # A vision-language checkpoint's whole config (LLaVA: vision_config, image token, ...);
    # `hf_config` is then its `text_config`, which everything sized by the decoder reads.
    hf_multimodal_config: Any = None
    # Most items of each modality one prompt may carry (`{"image": 2}`); None: no limit.
    limit_mm_per_prompt: dict[str, int] | None = None

    @property
    def is_pooling(self) -> bool:
        """True when the engine pools hidden states (embeddings, scores, class probabilities)
        instead of sampling."""
        return self.task in POOLING_TASKS

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        cfg = self.hf_config
        return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)

    @property
    def head_dim(self) -> int:
        cfg = self.hf_config
        explicit = getattr(cfg, "head_dim", None)
        return int(explicit) if explicit else cfg.hidden_size // cfg.num_attention_heads

    @property
    def sliding_window(self) -> int | None:
        window = getattr(self.hf_config, "sliding_window", None)
        if window is None or getattr(self.hf_config, "use_sliding_window", True) is False:
            return None
        return int(window)

    @classmethod
    def from_pretrained(
        cls,
        model: str,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        device: str = "cpu",
        seed: int = 0,
        load_format: str = "auto",
        tokenizer: str | None = None,
        skip_tokenizer_init: bool = False,
        quantization: str | None = None,
    ) -> ModelConfig:
        """Read `config.json` from a local directory (never from the network), or the metadata
        of a GGUF file (`model.gguf`; see `tokenwise.gguf`: its tokenizer directory is prepared
        here, with the file's chat template, so every engine process loads the same one)."""
        if load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(
                f"load_format must be auto, safetensors, gguf or dummy, got {load_format!r}"
            )
        if load_format == "gguf" or is_gguf_path(model):
            if load_format == "safetensors":
                raise ValueError(f"{model!r} is a GGUF file; use load_format='gguf' or 'auto'")
            hf_config = gguf_hf_config(model)
            load_format = "dummy" if load_format == "dummy" else "gguf"
            if not skip_tokenizer_init:
                tokenizer = prepare_tokenizer(model, tokenizer)
        else:
            hf_config = _read_hf_config(model)
        multimodal, hf_config = split_multimodal_config(hf_config)
        limit = max_position_embeddings(hf_config)
        if max_model_len is None:
            max_model_len = limit or 2048
        elif not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        elif limit is not None and max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}"
            )
        return cls(
            model=model,
            hf_config=hf_config,
            dtype=resolve_dtype(dtype, hf_config, device),
            max_model_len=max_model_len,
            seed=seed,
            load_format=load_format,
            tokenizer=tokenizer or model,
            skip_tokenizer_init=skip_tokenizer_init,
            architectures=list(getattr(multimodal or hf_config, "architectures", None) or []),
            quantization=resolve_quantization(quantization, hf_config, load_format, device),
            hf_multimodal_config=multimodal,
        )


def split_multimodal_config(hf_config: Any) -> tuple[Any, Any]:
    """`(whole config, text config)` of a vision-language checkpoint (one with a
    `vision_config` and a `text_config`), `(None, hf_config)` of any other. The text config
    takes the checkpoint's dtype when it names none, as transformers reads it."""
    text = getattr(hf_config, "text_config", None)
    if getattr(hf_config, "vision_config", None) is None or text is None:
        return None, hf_config
    if checkpoint_dtype(text) is None and checkpoint_dtype(hf_config) is not None:
        text.dtype = checkpoint_dtype(hf_config)
    return hf_config, text
