"""A tiny Qwen2.5-VL checkpoint and processor for tests.

Vision tower: 4x4 patches over 2 frames (a still image is repeated in time), hidden 32,
3 blocks of which block 1 attends over the whole image and blocks 0 and 2 within windows of
2x2 merged tokens (`window_size` 16 pixels = 2 merged tokens of 2x2 patches), so any image
larger than 16x16 pixels is cut into several windows; the merger joins 2x2 patches into one
row of the tiny Qwen2 decoder (hidden 64, 2 layers, head_dim 16, `mrope_section` [2, 3, 3]).
The processor (a `Qwen2_5_VLProcessor` with the PIL `Qwen2VLImageProcessorPil`) resizes each
image to multiples of 8 pixels between 64 and 4096 pixels, so images of different sizes
give different, non-square token grids. The byte-level tokenizer of `tests/tiny_checkpoints.py`
gets Qwen's vision special tokens. Weights use std 0.2 and noisy norms, so images change the
greedy tokens.
"""

from __future__ import annotations

import copy
import os
from functools import lru_cache
from typing import Any

import torch

from tests.tiny_checkpoints import tiny_tokenizer

IMAGE_TOKEN = "<|image_pad|>"
VISION_TOKENS = ["<|vision_start|>", IMAGE_TOKEN, "<|vision_end|>", "<|video_pad|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # where an image goes in a prompt
PATCH = 4
MERGE = 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}" + IMAGE + "{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@lru_cache(maxsize=1)
def qwen25vl_tokenizer() -> Any:
    tok = copy.deepcopy(tiny_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_qwen25vl(
    out_dir: str, seed: int = 0, mrope_section: tuple[int, int, int] = (2, 3, 3)
) -> str:
    """Write the checkpoint and its processor into `out_dir`; returns it."""
    import transformers

    tok = qwen25vl_tokenizer()
    ids = {name: tok.convert_tokens_to_ids(name) for name in VISION_TOKENS}
    vision = {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 4,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "window_size": 16,
        "fullatt_block_indexes": [1],
        "out_hidden_size": 64,
        "initializer_range": 0.2,
    }
    text = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
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
            "mrope_section": list(mrope_section),
        },
    }
    config = transformers.Qwen2_5_VLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=ids[IMAGE_TOKEN],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    return save_noisy(model, out_dir, seed)


def save_noisy(model: Any, out_dir: str, seed: int) -> str:
    """Give `model` the test weights (see above), then save it with the image processor and
    the tokenizer into `out_dir`; returns it."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # norms near 1, biases near 0, both noisy
                noise = torch.randn(param.shape, generator=generator) * 0.1
                param.copy_(noise + (0.0 if name.endswith("bias") else 1.0))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
        min_pixels=64,
        max_pixels=4096,
    )
    image_processor.save_pretrained(out_dir)
    qwen25vl_tokenizer().save_pretrained(out_dir)
    return out_dir


def hf_processor(path: str, processor: str = "Qwen2_5_VLProcessor") -> Any:
    """HF's `processor` (Qwen3.5's is `Qwen3VLProcessor`) over the checkpoint's image
    processor and tokenizer: the reference's inputs. Built by hand, because transformers
    checks its video processor's class, which needs torchvision (not installed); images never
    reach the video processor."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    cls = getattr(transformers, processor)
    original = cls.check_argument_for_proper_class
    cls.check_argument_for_proper_class = lambda self, name, arg: None  # type: ignore[method-assign]
    try:
        return cls(
            image_processor=Qwen2VLImageProcessorPil.from_pretrained(path),
            tokenizer=transformers.AutoTokenizer.from_pretrained(path),
            video_processor=None,
        )
    finally:
        cls.check_argument_for_proper_class = original  # type: ignore[method-assign]
