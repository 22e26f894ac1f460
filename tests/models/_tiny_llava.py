"""A tiny LLaVA checkpoint and processor for tests, and images to feed it.

CLIP tower: 32x32 images in 8x8 patches (16 patches + the class token), hidden 32, 2 layers;
projector to the tiny Llama (hidden 64, 2 layers) of `tests/tiny_checkpoints.py`, whose
byte-level tokenizer gets `<image>` as an added special token. The processor (a
`LlavaProcessor` with a `CLIPImageProcessor`: shortest edge 32, centre crop 32x32) is saved
beside the weights, so `AutoProcessor` loads it as a real checkpoint's. Weights use std 0.2
and noisy norms (as the other tiny checkpoints do), so images change the greedy tokens.
"""

from __future__ import annotations

import copy
import os
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from tests.tiny_checkpoints import tiny_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32
PATCH = 8
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2  # "default" strategy: the class token dropped
# Content parts of a chat message: text as is, an image part as the placeholder.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}" + IMAGE_TOKEN + "{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@lru_cache(maxsize=1)
def llava_tokenizer() -> Any:
    tok = copy.deepcopy(tiny_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_llava(out_dir: str, seed: int = 0, tower: str = "clip") -> str:
    """Write the checkpoint and its processor into `out_dir`; returns it.

    `tower="siglip"`: a SigLIP tower (no class token, so the "full" strategy: 16 rows per
    image) read at its last layer, with a `SiglipImageProcessor` (32x32, no crop).
    """
    import transformers

    tok = llava_tokenizer()
    siglip = tower == "siglip"
    vision_cls = transformers.SiglipVisionConfig if siglip else transformers.CLIPVisionConfig
    vision = vision_cls(
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        initializer_range=0.2,
        initializer_factor=5.0,
    )
    text = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tok),
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-1 if siglip else -2,
        vision_feature_select_strategy="full" if siglip else "default",
        initializer_range=0.2,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # norms near 1, biases near 0, both noisy
                noise = torch.randn(param.shape, generator=generator) * 0.1
                param.copy_(noise + (0.0 if name.endswith("bias") else 1.0))
            elif "vision_tower" in name or "projector" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    if siglip:
        image_processor = transformers.SiglipImageProcessor(
            size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        )
    else:
        image_processor = transformers.CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=PATCH,
        vision_feature_select_strategy="full" if siglip else "default",
        num_additional_image_tokens=0 if siglip else 1,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    return out_dir


def make_image(seed: int, width: int, height: int) -> Any:
    """A random RGB image of the given size (smooth enough that resizing keeps it distinct)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(height // 4, 1), max(width // 4, 1), 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height))
