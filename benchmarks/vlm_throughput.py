"""Throughput of a batch of image prompts on a LLaVA, Qwen2.5-VL or Gemma 3 checkpoint:
images/s and output tok/s.

    python benchmarks/vlm_throughput.py [--model PATH] [--arch llava|qwen2_5_vl|gemma3]
        [--num-requests 32] [--distinct-images 8] [--max-tokens 32]
        [--max-num-batched-tokens 2048]

N requests ask about images drawn from K distinct ones (request i gets image i mod K), greedy,
`ignore_eos` so every request makes `--max-tokens` tokens. Printed: images/s and output tok/s
over the whole batch (wall time of `generate`, best of `--repeats` runs on a fresh engine),
the vision tower's encodings, the encoder cache's hits, and the prompt tokens the prefix cache
served (a repeated image with the same text is a prefix hit: its request never runs the
tower).

Without `--model` a random LLaVA is built in a temporary directory: a CLIP ViT of 224x224
images in 14x14 patches (256 image tokens, hidden 384, 6 layers) and the built-in model's
Llama configuration and tokenizer (hidden 256, 4 layers) with an `<image>` token added.
`--arch qwen2_5_vl` builds a random Qwen2.5-VL instead: a windowed ViT in 14x14 patches
(hidden 384, 8 blocks, full attention in blocks 3 and 7, 112-pixel windows) whose 300x400
images become 22x28 patches, 154 tokens, and a Qwen2 decoder of the built-in model's sizes with
M-RoPE. `--arch gemma3` builds a random Gemma 3: a SigLIP ViT of 224x224 images in 14x14
patches (hidden 384, 6 layers) pooled to 64 tokens per image, and a Gemma 3 text model of the
built-in model's sizes (sliding window 512 in five of every six layers; image tokens attend to
each other both ways, and no chunk cuts an image). Weights are random: the figures are the
engine's cost, not the answers' quality.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenwise import SamplingParams  # noqa: E402
from tokenwise.entrypoints.llm import LLM  # noqa: E402


def build_random_llava(out_dir: str) -> str:
    import torch
    import transformers

    from tokenwise.default_model import resolve_model_path

    base = resolve_model_path(None)
    tok = transformers.AutoTokenizer.from_pretrained(base)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = transformers.AutoConfig.from_pretrained(base)
    text.vocab_size = len(tok)
    vision = transformers.CLIPVisionConfig(
        image_size=224,
        patch_size=14,
        hidden_size=384,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=6,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(config).save_pretrained(out_dir)
    processor = transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessor(
            size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}
        ),
        tokenizer=tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(out_dir)
    return out_dir


def build_random_qwen2_5_vl(out_dir: str) -> str:
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from tokenwise.default_model import resolve_model_path

    base = resolve_model_path(None)
    tok = transformers.AutoTokenizer.from_pretrained(base)
    vision_tokens = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tok.add_special_tokens({"additional_special_tokens": vision_tokens})
    llama = transformers.AutoConfig.from_pretrained(base)
    text = {
        name: getattr(llama, name)
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "rms_norm_eps",
            "bos_token_id",
            "eos_token_id",
            "max_position_embeddings",
        )
    }
    text["vocab_size"] = len(tok)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    text["rope_parameters"]["mrope_section"] = [8, 12, 12]  # head_dim 64
    vision = {
        "depth": 8,
        "hidden_size": 384,
        "intermediate_size": 1536,
        "num_heads": 6,
        "fullatt_block_indexes": [3, 7],
        "out_hidden_size": llama.hidden_size,
    }
    ids = {t: tok.convert_tokens_to_ids(t) for t in vision_tokens}
    config = transformers.Qwen2_5_VLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(0)
    transformers.Qwen2_5_VLForConditionalGeneration(config).save_pretrained(out_dir)
    Qwen2VLImageProcessorPil().save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def build_random_gemma3(out_dir: str) -> str:
    import torch
    import transformers

    from tokenwise.default_model import resolve_model_path

    base = resolve_model_path(None)
    names = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>"}
    names["eoi_token"] = "<end_of_image>"
    tok = transformers.AutoTokenizer.from_pretrained(base, extra_special_tokens=names)
    tok.add_special_tokens({"extra_special_tokens": list(names.values())})
    llama = transformers.AutoConfig.from_pretrained(base)
    heads = llama.num_attention_heads
    text = transformers.Gemma3TextConfig(
        hidden_size=llama.hidden_size,
        intermediate_size=llama.intermediate_size,
        num_hidden_layers=llama.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=llama.num_key_value_heads,
        head_dim=llama.hidden_size // heads,
        vocab_size=len(tok),
        max_position_embeddings=llama.max_position_embeddings,
        sliding_window=512,
        bos_token_id=llama.bos_token_id,
        eos_token_id=llama.eos_token_id,
    )
    vision = transformers.SiglipVisionConfig(
        image_size=224,
        patch_size=14,
        hidden_size=384,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=6,
        vision_use_head=False,
    )
    ids = {key: tok.convert_tokens_to_ids(t) for key, t in names.items()}
    config = transformers.Gemma3Config(
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=64,
        image_token_index=ids["image_token"],
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(out_dir)
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 224, "width": 224}),
        tokenizer=tok,
        image_seq_length=64,
    )
    processor.save_pretrained(out_dir)
    return out_dir


BUILDERS = {
    "llava": build_random_llava,
    "qwen2_5_vl": build_random_qwen2_5_vl,
    "gemma3": build_random_gemma3,
}
IMAGE_PLACEHOLDER = {
    "llava": "<image>\n",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma3": "<start_of_image>",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a checkpoint (default: random)")
    parser.add_argument(
        "--arch", choices=sorted(BUILDERS), default="llava", help="the random model's kind"
    )
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--distinct-images", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from PIL import Image

    model = args.model or BUILDERS[args.arch](tempfile.mkdtemp(prefix=f"tokenwise-{args.arch}-"))
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8))
        for _ in range(args.distinct_images)
    ]
    prompts = [
        {
            "prompt": f"USER: {IMAGE_PLACEHOLDER[args.arch]}What is in this picture? ASSISTANT:",
            "multi_modal_data": {"image": images[i % len(images)]},
        }
        for i in range(args.num_requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    best = None
    for _ in range(args.repeats):
        llm = LLM(model, max_num_batched_tokens=args.max_num_batched_tokens)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        runner = llm.llm_engine.runner
        stats = (
            elapsed,
            sum(len(o.outputs[0].token_ids) for o in outs),
            runner.num_encoder_runs,
            runner.encoder_cache.num_hits,
            sum(o.num_cached_tokens for o in outs),
            sum(len(o.prompt_token_ids) for o in outs),
        )
        best = stats if best is None or stats[0] < best[0] else best
        llm.shutdown()
    assert best is not None
    elapsed, out_tokens, encodings, hits, cached, prompt_tokens = best
    n = args.num_requests
    print(
        f"{n} image prompts ({args.distinct_images} distinct images), {args.max_tokens} tokens "
        f"each: {n / elapsed:.1f} images/s, {out_tokens / elapsed:.1f} out tok/s "
        f"({elapsed:.2f} s)"
    )
    print(
        f"vision tower ran {encodings} times; encoder-cache hits {hits}; prefix cache served "
        f"{cached} of {prompt_tokens} prompt tokens"
    )


if __name__ == "__main__":
    main()
