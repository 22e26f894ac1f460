"""A tiny Qwen3.5 vision-language checkpoint (dense or MoE) and HF's processor for it.

Vision tower: 4x4 patches over 2 frames, hidden 32, 2 blocks, a learned 4x4 position table
(resampled to every image's grid), merger of 2x2 patches into one row of the decoder. Decoder:
the Gated DeltaNet hybrid of `tests/tiny_checkpoints.py` (layers linear, full, linear, full;
head_dim 32 with half of it rotated, `mrope_section` [3, 3, 2] interleaved). The processor,
tokenizer and image sizes are the Qwen2.5-VL test's (`_tiny_qwen25vl.py`): images of different
sizes give different, non-square token grids. Weights use std 0.2 and noisy norms, so images
change the greedy tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.models._tiny_qwen25vl import (
    IMAGE_TOKEN,
    MERGE,
    PATCH,
    VISION_TOKENS,
    qwen25vl_tokenizer,
    save_noisy,
)
from tests.tiny_checkpoints import _GDN, _GDN_MOE

LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def build_tiny_qwen35vl(out_dir: str, moe: bool = False, seed: int = 0) -> str:
    """Write the checkpoint and its processor into `out_dir`; returns it."""
    import transformers

    tok = qwen25vl_tokenizer()
    ids = {name: tok.convert_tokens_to_ids(name) for name in VISION_TOKENS}
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 4,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 16,
        "initializer_range": 0.2,
    }
    text: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        **_GDN,  # the text tests' Gated DeltaNet sizes (4 layers, head_dim 32)
        "layer_types": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": len(tok),
        "max_position_embeddings": 512,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.2,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
    }
    if moe:
        text.update(_GDN_MOE)
    config_cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    model_cls = (
        transformers.Qwen3_5MoeForConditionalGeneration
        if moe
        else transformers.Qwen3_5ForConditionalGeneration
    )
    config = config_cls(
        vision_config=vision,
        text_config=text,
        image_token_id=ids[IMAGE_TOKEN],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    return save_noisy(model_cls(config).eval(), out_dir, seed)
