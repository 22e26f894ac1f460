"""A tiny Gemma 3 vision-language checkpoint and processor for tests.

SigLIP tower: 32x32 images in 4x4 patches (an 8x8 grid), hidden 32, 2 layers; the projector
average-pools the grid 2x2 into `mm_tokens_per_image` = 16 rows. The text model is Gemma 3
(hidden 64, 3 layers: sliding, global, sliding, window 8) over the byte-level tokenizer of
`tests/tiny_checkpoints.py` with Gemma's three image tokens added (`<start_of_image>`, the
soft token the processor repeats 16 times, `<end_of_image>`). The window (8) is shorter than
an image (16), so sliding layers cut images and the "bidirectional within an image, inside the
window" rule is exercised. The processor (a `Gemma3Processor` with `Gemma3ImageProcessor`,
32x32) is saved beside the weights, as a real checkpoint's. Weights use std 0.2 and noisy
norms (as the other tiny checkpoints do), so images change the greedy tokens.
"""

from __future__ import annotations

import copy
import os
from functools import lru_cache
from typing import Any

import torch

from tests.tiny_checkpoints import tiny_tokenizer

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
IMAGE_SIZE = 32
PATCH = 4
TOKENS_PER_IMAGE = 16
SLIDING_WINDOW = 8


def tokenizer_with_image_tokens(boi: str, image: str, eoi: str, max_length: int) -> Any:
    """The tiny tokenizer with Gemma's three image tokens added (ids after the text's), named
    as Gemma's processors read them (`boi_token`, `image_token`, `eoi_token`)."""
    from transformers import PreTrainedTokenizerFast

    base = tiny_tokenizer()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=copy.deepcopy(base.backend_tokenizer),
        bos_token=base.bos_token,
        eos_token=base.eos_token,
        model_max_length=max_length,
        extra_special_tokens={"boi_token": boi, "image_token": image, "eoi_token": eoi},
    )
    tok.add_special_tokens({"extra_special_tokens": [boi, image, eoi]})
    return tok


@lru_cache(maxsize=1)
def gemma3_tokenizer() -> Any:
    """The tiny tokenizer with Gemma 3's image tokens."""
    return tokenizer_with_image_tokens(BOI, IMAGE, EOI, 512)


def build_tiny_gemma3_vl(out_dir: str, seed: int = 0) -> str:
    """Write the checkpoint and its processor into `out_dir`; returns it."""
    import transformers

    tok = gemma3_tokenizer()
    vision = transformers.SiglipVisionConfig(
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    text = transformers.Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        vocab_size=len(tok),
        max_position_embeddings=512,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        tie_word_embeddings=False,  # tied, this tiny model repeats one token whatever it reads
    )
    config = transformers.Gemma3Config(
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        image_token_index=tok.convert_tokens_to_ids(IMAGE),
        boi_token_index=tok.convert_tokens_to_ids(BOI),
        eoi_token_index=tok.convert_tokens_to_ids(EOI),
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # norms near their neutral value, biases near 0, all noisy
                noise = torch.randn(param.shape, generator=generator) * 0.1
                neutral = 1.0 if "vision_tower" in name and name.endswith("weight") else 0.0
                param.copy_(noise + neutral)
            elif "vision_tower" in name or "projector" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    image_processor = transformers.Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=tok, image_seq_length=TOKENS_PER_IMAGE
    )
    processor.save_pretrained(out_dir)
    return out_dir
