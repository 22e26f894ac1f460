"""Qwen3.5 with its vision tower against Hugging Face: prompts with images of any size give HF's
greedy tokens (fp32) however the engine cuts or caches them, on the Gated DeltaNet hybrid.

The tiny checkpoints (`_tiny_qwen35vl.py`, dense and MoE) turn a 40x56 image into 5x7 tokens,
a 70x33 one into 9x4 and a 20x24 one into 3x3. References are HF `generate` on the inputs of
HF's `Qwen3VLProcessor` (Qwen3.5's). Each engine setting forces one path: a token budget
smaller than an image (chunks start and stop inside images), a repeated image (prefix-cache
hits through it, resumed from a recurrent-state snapshot inside the image), the same text with
another image (no false sharing).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from tests.engine._fixtures import assert_pool_clean
from tests.models._grid_vl import (
    GREEDY,
    Specs,
    assert_tower_equals_hf,
    engine_prompt,
    hf_greedy,
    hf_inputs,
    record_image_cuts,
    rotate_like_hf,
    strip_eos,
)
from tests.models._tiny_qwen25vl import IMAGE
from tests.models._tiny_qwen35vl import build_tiny_qwen35vl
from tokenwise.entrypoints.llm import LLM

ONE_IMAGE = ("USER: " + IMAGE + "What is in the picture? ASSISTANT:", ((0, 40, 56),))
CASES: list[tuple[str, Specs]] = [
    ONE_IMAGE,
    ("The cat " + IMAGE + " and the dog " + IMAGE + " sat on the", ((1, 70, 33), (2, 20, 24))),
    ("Hello world! Hello tokenwise, a small", ()),
]


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_qwen35vl(str(tmp_path_factory.mktemp("qwen35vl") / "ckpt"))


def outputs(llm: LLM, cases: list[tuple[str, Specs]]) -> list[Any]:
    return llm.generate([engine_prompt(*c) for c in cases], GREEDY, use_tqdm=False)


def tokens(llm: LLM, outs: list[Any]) -> list[list[int]]:
    eos = llm.llm_engine.eos_token_ids[0]
    return [strip_eos(list(o.outputs[0].token_ids), eos) for o in outs]


@pytest.mark.parametrize("budget", [512, 12], ids=["whole-prompts", "chunks-cut-images"])
def test_mixed_batch_equals_hf(dense_dir: str, budget: int) -> None:
    """Text + one image, two images of different sizes, and text alone, in one batch. (A
    hybrid's prompt chunks end on block boundaries, for its state snapshots, so even a budget
    larger than the batch may cut an image; a budget of 12 cuts every image.)"""
    llm = LLM(
        dense_dir, dtype="float32", num_gpu_blocks=64, block_size=8, max_num_batched_tokens=budget
    )
    cuts = record_image_cuts(llm)
    outs = outputs(llm, CASES)
    assert tokens(llm, outs) == [hf_greedy(dense_dir, *c) for c in CASES]
    # The processor's expansion is HF's: same token ids, one run of placeholders per image.
    for out, case in zip(outs, CASES, strict=True):
        assert out.prompt_token_ids == hf_inputs(dense_dir, *case)["input_ids"][0].tolist()
    assert budget == 512 or sum(cuts) >= 3
    # The images do steer the model: the same text with another image answers otherwise.
    other = (ONE_IMAGE[0], ((9, 40, 56),))
    assert tokens(llm, outputs(llm, [other])) == [hf_greedy(dense_dir, *other)]
    assert hf_greedy(dense_dir, *other) != hf_greedy(dense_dir, *ONE_IMAGE)
    runner = llm.llm_engine.runner
    assert runner.kind_part.num_encoder_runs == 4  # each distinct image once, however many chunks
    assert len(runner.kind_part.encoder_cache) == 0
    assert_pool_clean(llm.llm_engine)


def test_prefix_hits_resume_recurrent_state_inside_an_image(dense_dir: str) -> None:
    """Chunks of 16 tokens leave a recurrent-state snapshot at every chunk's end. A repeated
    prompt hits through its image; the same image with other text after it hits up to a
    snapshot inside the image and computes the rest of it (rows and 3-D positions) from
    there; another image of the same size never hits past the text before it."""
    llm = LLM(
        dense_dir, dtype="float32", num_gpu_blocks=64, block_size=8, max_num_batched_tokens=16
    )
    engine = llm.llm_engine
    (first,) = outputs(llm, [ONE_IMAGE])
    (again,) = outputs(llm, [ONE_IMAGE])
    image = first.prompt_token_ids.index(engine.kind.image_token_id)
    image_end = image + 5 * 7
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens > image_end  # through the whole image
    assert tokens(llm, [first, again]) == [hf_greedy(dense_dir, *ONE_IMAGE)] * 2
    assert engine.runner.kind_part.num_encoder_runs == 1  # the hit covered the image
    tail = ("USER: " + IMAGE + "Who is it? ASSISTANT:", ONE_IMAGE[1])
    (resumed,) = outputs(llm, [tail])
    assert image < resumed.num_cached_tokens < image_end  # the hit ends inside the image
    assert tokens(llm, [resumed]) == [hf_greedy(dense_dir, *tail)]
    other = (ONE_IMAGE[0], ((5, 40, 56),))
    (fresh,) = outputs(llm, [other])
    assert fresh.num_cached_tokens <= image // 8 * 8
    assert tokens(llm, [fresh]) == [hf_greedy(dense_dir, *other)]
    assert_pool_clean(engine)


def test_moe_variant_equals_hf(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`Qwen3_5MoeForConditionalGeneration`: the same tower and positions over the MoE decoder."""
    path = build_tiny_qwen35vl(str(tmp_path_factory.mktemp("qwen35moevl") / "ckpt"), moe=True)
    llm = LLM(path, dtype="float32", num_gpu_blocks=64, block_size=8, max_num_batched_tokens=12)
    cases = CASES[:2]
    assert tokens(llm, outputs(llm, cases)) == [hf_greedy(path, *c) for c in cases]


def test_two_pipeline_stages_equal_hf(dense_dir: str) -> None:
    """Pipeline parallelism: the first stage (layers linear, full) holds the tower and embeds
    the images, the second (linear, full) gets the 3-D positions in the step message; chunks
    that cut images give HF's tokens."""
    llm = LLM(
        dense_dir,
        dtype="float32",
        pipeline_parallel_size=2,
        num_gpu_blocks=128,
        block_size=8,
        max_num_batched_tokens=12,
    )
    try:
        assert tokens(llm, outputs(llm, CASES)) == [hf_greedy(dense_dir, *c) for c in CASES]
        runner = llm.llm_engine.runner
        assert runner.model.model.end_layer == 2  # the other two layers are the second stage's
        assert runner.kind_part.num_encoder_runs == 3
        assert_pool_clean(llm.llm_engine)
    finally:
        llm.shutdown()


def test_interleaved_mrope_equals_hf_rotary() -> None:
    """The decoder's rotary on `[3, T]` positions turns q and k as HF's Qwen3.5 text rotary
    (time, height and width frequencies interleaved over the rotated quarter of each head),
    and differs from Qwen2.5-VL's banded layout on the same sections."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen

    from tokenwise.layers.mrope import MRotaryEmbedding

    section = [11, 11, 10]
    config = transformers.Qwen3_5TextConfig(
        hidden_size=512,
        num_attention_heads=2,
        head_dim=256,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": section,
            "mrope_interleaved": True,
        },
    )
    hf_rope = hf_qwen.Qwen3_5TextRotaryEmbedding(config)
    ours = MRotaryEmbedding(64, 512, 1e7, section, interleaved=True)
    positions, q, k = rotate_like_hf(hf_qwen, hf_rope, ours, 64)
    banded_q, _ = MRotaryEmbedding(64, 512, 1e7, section)(positions, q, k)
    assert not torch.allclose(banded_q, ours(positions, q, k)[0], atol=1e-3)


def test_vision_tower_equals_hf(dense_dir: str) -> None:
    """The tower's rows for images of three sizes, run as one batch, are HF's
    `get_image_features` (resampled learned positions, 2-D rotary, merger)."""
    llm = LLM(dense_dir, dtype="float32", num_gpu_blocks=16, block_size=8, max_model_len=128)
    model_ = llm.llm_engine.runner.kind_part.eager_model
    pixels, grids = assert_tower_equals_hf(dense_dir, model_)
    # Bad inputs to the tower are refused by name, not deep inside it.
    with pytest.raises(ValueError, match=r"image 1: grid_thw \(1, 5, 4\).*multiples of 2"):
        model_.embed_image_list(pixels[:2], [grids[0], (1, 5, 4)])
    with pytest.raises(ValueError, match=r"image 0: pixel_values of shape .* grid_thw"):
        model_.embed_image_list(pixels[1:2], grids[:1])


def test_bad_image_inputs_are_refused_by_name(dense_dir: str) -> None:
    llm = LLM(dense_dir, dtype="float32", num_gpu_blocks=16, block_size=8, max_model_len=128)
    text = ONE_IMAGE[0]
    with pytest.raises(ValueError, match=r"multi_modal_data\['image'\]\[0\] must be a PIL"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": "cat.png"}}, GREEDY)
    with pytest.raises(ValueError, match=r"1 image placeholder.*but 2 image\(s\)"):
        llm.generate(engine_prompt(text, ((0, 40, 56), (1, 20, 24))), GREEDY)
    with pytest.raises(ValueError, match="image processor refused the input"):
        llm.generate(engine_prompt(text, ((0, 900, 4),)), GREEDY)  # aspect ratio over 200
    assert_pool_clean(llm.llm_engine)


def test_images_turned_off_serve_the_text_model(dense_dir: str) -> None:
    """`limit_mm_per_prompt={"image": 0}` (vLLM's language-model-only mode): the checkpoint
    runs as its text model (no tower, the generate kind), so speculative decoding, refused for
    vision-language models, is taken; text answers stay HF's, an image is refused by name."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(
        dense_dir,
        dtype="float32",
        num_gpu_blocks=32,
        block_size=8,
        max_model_len=128,
        limit_mm_per_prompt={"image": 0},
        speculative_config=spec,
    )
    engine = llm.llm_engine
    assert engine.kind.name == "generate"
    model = engine.runner.model
    assert not [name for name, _ in model.named_parameters() if "visual" in name]
    text = CASES[2]
    assert tokens(llm, outputs(llm, [text])) == [hf_greedy(dense_dir, *text)]
    with pytest.raises(ValueError, match=r"Qwen3_5ForConditionalGeneration\) takes text only"):
        llm.generate(engine_prompt(*ONE_IMAGE), GREEDY)
    with pytest.raises(ValueError, match="speculative_config applies to text-only"):
        LLM(dense_dir, dtype="float32", num_gpu_blocks=32, speculative_config=spec)
