"""A tiny Gemma 4 checkpoint with its vision tower, and its image processor, for tests.

Vision tower: 2x2-pixel patches, at most 70 soft tokens per image (the processor's smallest
budget) pooled 2x2 from at most 280 patches, so an image keeps its aspect ratio and has its
own number of soft tokens (up to 70); hidden 32, 2 layers, 2 query heads over 1 KV head,
clipped linears with finite bounds and standardized outputs (so every optional piece is
exercised). The text model is the "dense" tiny Gemma 4 of `tests/tiny_checkpoints.py`
(sliding, sliding, global, sliding, global; window 8, shorter than any image) over the tiny
byte-level tokenizer with Gemma 4's three image tokens added. `bidirectional` says what
`use_bidirectional_attention` the text config carries: "vision" (the larger hub models: image
tokens attend both ways in sliding layers) or None (causal everywhere).

Only the image processor is saved beside the weights: transformers' `Gemma4Processor` needs a
video processor, which needs torchvision.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

import torch

from tests.models._tiny_gemma3_vl import tokenizer_with_image_tokens
from tests.tiny_checkpoints import _perturb, tiny_config

BOI, IMAGE, EOI = "<|image>", "<|image|>", "<image|>"
PATCH = 2
POOLING = 2
MAX_SOFT_TOKENS = 70


@lru_cache(maxsize=1)
def gemma4_tokenizer() -> Any:
    """The tiny tokenizer with Gemma 4's image tokens."""
    return tokenizer_with_image_tokens(BOI, IMAGE, EOI, 1024)


def image_processor() -> Any:
    import transformers

    return transformers.Gemma4ImageProcessorPil(
        patch_size=PATCH, pooling_kernel_size=POOLING, max_soft_tokens=MAX_SOFT_TOKENS
    )


def build_tiny_gemma4_vl(
    out_dir: str, bidirectional: str | None = "vision", seed: int = 0, **text: Any
) -> str:
    """Write the checkpoint and its image processor into `out_dir`; returns it. `text`:
    overrides of the text config (e.g. `layer_types` with `num_hidden_layers`)."""
    import transformers

    tok = gemma4_tokenizer()
    text = tiny_config(
        "Gemma4ForCausalLM",
        use_bidirectional_attention=bidirectional,
        vocab_size=len(tok),
        pad_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **text,
    ).to_dict()
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "patch_size": PATCH,
        "pooling_kernel_size": POOLING,
        "position_embedding_size": 64,
        "use_clipped_linears": True,
        "standardize": True,
    }
    config = transformers.Gemma4Config(
        text_config=text,
        vision_config=vision,
        image_token_id=tok.convert_tokens_to_ids(IMAGE),
        boi_token_id=tok.convert_tokens_to_ids(BOI),
        eoi_token_id=tok.convert_tokens_to_ids(EOI),
        architectures=["Gemma4ForConditionalGeneration"],
    )
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    _perturb(model, seed)
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("vision" in name) and param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
        for name, buffer in model.named_buffers():
            # Clip bounds that bind for some values, and a visible standardization.
            noise = torch.rand(buffer.shape, generator=generator)
            if name.endswith(("input_min", "output_min")):
                buffer.copy_(-1.0 - noise)
            elif name.endswith(("input_max", "output_max")):
                buffer.copy_(1.0 + noise)
            elif name.endswith("std_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator))
            elif name.endswith("std_scale"):
                buffer.copy_(0.5 + noise)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    image_processor().save_pretrained(out_dir)
    return out_dir
