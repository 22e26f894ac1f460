"""What the HF-parity tests of the M-RoPE vision-language models (Qwen2.5-VL, Qwen3.5) share:
the images of a case, the engine's prompt for it, HF's greedy reference (fp32, cached per
checkpoint and case) and a spy on the chunks that cut images."""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import transformers

from tests.models._tiny_llava import make_image
from tests.models._tiny_qwen25vl import hf_processor
from tokenwise.sampling.params import SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
Specs = tuple[tuple[int, int, int], ...]  # (seed, width, height) of each image
# HF's processor of each architecture (Qwen3.5 has none of its own).
PROCESSORS = {"Qwen2_5_VLForConditionalGeneration": "Qwen2_5_VLProcessor"}


@cache
def hf_parts(path: str) -> tuple[Any, Any]:
    """HF's model (fp32, eval) and processor of the checkpoint at `path`."""
    arch = transformers.AutoConfig.from_pretrained(path).architectures[0]
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32)
    return model.eval(), hf_processor(path, PROCESSORS.get(arch, "Qwen3VLProcessor"))


def images_of(specs: Specs) -> list[Any]:
    return [make_image(*spec) for spec in specs]


def hf_inputs(path: str, prompt: str, specs: Specs) -> Any:
    return hf_parts(path)[1](images=images_of(specs) or None, text=prompt, return_tensors="pt")


def strip_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@cache
def hf_greedy(path: str, prompt: str, specs: Specs) -> list[int]:
    model = hf_parts(path)[0]
    inputs = hf_inputs(path, prompt, specs)
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    eos = model.config.text_config.eos_token_id
    return strip_eos(out[0, inputs["input_ids"].shape[1] :].tolist(), eos)


def engine_prompt(prompt: str, specs: Specs) -> Any:
    if not specs:
        return prompt
    images = images_of(specs)
    return {
        "prompt": prompt,
        "multi_modal_data": {"image": images[0] if len(images) == 1 else images},
    }


def record_image_cuts(llm: Any) -> list[bool]:
    """Spy on the runner: one flag per scheduled chunk that starts or ends inside an image."""
    runner = llm.llm_engine.runner
    cuts: list[bool] = []
    execute = runner.execute_model

    def spy(scheduler_output: Any) -> Any:
        for item in scheduler_output.scheduled:
            lo = item.request.num_computed_tokens
            hi = lo + item.num_new_tokens
            for image in getattr(item.request, "images", ()):
                cuts.append(image.offset < lo < image.end or image.offset < hi < image.end)
        return execute(scheduler_output)

    runner.execute_model = spy
    return cuts


def assert_tower_equals_hf(path: str, model: Any) -> tuple[list[Any], list[Any]]:
    """The engine model's tower rows for images of three sizes, run as one batch, equal HF's
    `get_image_features`; returns the images' pixels and grids."""
    hf_model, processor = hf_parts(path)
    images = images_of(((1, 70, 33), (2, 20, 24), (0, 40, 56)))
    inputs = processor.image_processor(images=images, return_tensors="pt")
    with torch.no_grad():
        want = hf_model.model.get_image_features(
            inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True
        ).pooler_output
    grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    pixels = list(inputs["pixel_values"].split([t * h * w for t, h, w in grids]))
    with torch.inference_mode():
        got = model.embed_image_list(pixels, grids)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    return pixels, grids


def rotate_like_hf(hf_module: Any, hf_rope: Any, ours: Any, head_dim: int) -> tuple[Any, Any, Any]:
    """q (2 heads) and k (1 head) at random `[3, 7]` positions, rotated by `ours` and by HF's
    text rotary (`hf_rope`, applied with `hf_module.apply_rotary_pos_emb`) must agree;
    returns the positions, q and k for further checks."""
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 500, (3, 7), generator=generator)
    q = torch.randn(7, 2, head_dim, generator=generator)
    k = torch.randn(7, 1, head_dim, generator=generator)
    cos, sin = hf_rope(q, positions[:, None, :])
    # HF: [batch, heads, T, head_dim] with cos/sin [batch, T, head_dim].
    want_q, want_k = hf_module.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    got_q, got_k = ours(positions, q, k)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    return positions, q, k
