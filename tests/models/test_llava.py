"""LLaVA against Hugging Face: prompts with images give HF's greedy tokens, however the engine
cuts, shares or recomputes them.

The tiny checkpoint (`_tiny_llava.py`) has 16 placeholder tokens per image. References are HF
`generate` (fp32) on the inputs of the checkpoint's own processor. Each engine setting is
chosen to force one path: a token budget smaller than one image (every image's placeholders
are cut across chunks), a repeated image (prefix-cache hits through the image), the same
text with another image (no false sharing), and a pool too small for the batch (preemption,
then recomputation with the image embedded again).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.engine._fixtures import assert_pool_clean
from tests.models._tiny_llava import TOKENS_PER_IMAGE, build_tiny_llava, make_image
from tokenwise.entrypoints.llm import LLM
from tokenwise.models.llava import checkpoint_name
from tokenwise.sampling.params import SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

# (prompt, image specs (seed, width, height)): one image, two of different sizes, text only,
# an image first.
CASES: list[tuple[str, tuple[tuple[int, int, int], ...]]] = [
    ("USER: <image>\nWhat is in the picture? ASSISTANT:", ((0, 40, 50),)),
    ("The cat <image> and the dog <image> sat on the", ((1, 70, 33), (2, 20, 24))),
    ("Hello world! Hello tokenwise, a small", ()),
    ("<image>def fibonacci(n):", ((3, 64, 64),)),
]


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llava(str(tmp_path_factory.mktemp("llava") / "ckpt"))


@cache
def hf_parts(path: str) -> tuple[Any, Any]:
    model = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    processor = transformers.AutoProcessor.from_pretrained(path, backend="pil")
    return model.eval(), processor


def images_of(specs: tuple[tuple[int, int, int], ...]) -> list[Any]:
    return [make_image(*spec) for spec in specs]


def strip_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@cache
def hf_greedy(path: str, prompt: str, specs: tuple[tuple[int, int, int], ...]) -> list[int]:
    model, processor = hf_parts(path)
    images = images_of(specs) or None
    inputs = processor(images=images, text=prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    return strip_eos(
        out[0, inputs["input_ids"].shape[1] :].tolist(), model.config.text_config.eos_token_id
    )


def engine_prompt(prompt: str, specs: tuple[tuple[int, int, int], ...]) -> Any:
    if not specs:
        return prompt
    images = images_of(specs)
    return {
        "prompt": prompt,
        "multi_modal_data": {"image": images[0] if len(images) == 1 else images},
    }


def run(llm: LLM, cases: list[tuple[str, tuple[tuple[int, int, int], ...]]]) -> list[list[int]]:
    outs = llm.generate([engine_prompt(*c) for c in cases], GREEDY, use_tqdm=False)
    eos = llm.llm_engine.eos_token_ids[0]
    return [strip_eos(list(o.outputs[0].token_ids), eos) for o in outs]


@pytest.mark.parametrize("budget", [512, 12], ids=["whole-prompts", "chunks-cut-images"])
def test_mixed_batch_equals_hf(llava_dir: str, budget: int) -> None:
    # A budget of 12 < 16 placeholder tokens: every image is split across steps.
    llm = LLM(
        llava_dir, dtype="float32", num_gpu_blocks=64, block_size=8, max_num_batched_tokens=budget
    )
    got = run(llm, CASES)
    assert got == [hf_greedy(llava_dir, *c) for c in CASES]
    # The images do steer the model: the same text with another image answers differently.
    other = [(CASES[0][0], ((9, 30, 30),))]
    assert run(llm, other) == [hf_greedy(llava_dir, *other[0])] != [got[0]]
    runner = llm.llm_engine.runner
    # Each of the 4 + 1 distinct images was encoded once, however many chunks read it.
    assert runner.kind_part.num_encoder_runs == 5
    assert len(runner.kind_part.encoder_cache) == 0  # nothing kept once the prefills were done
    assert_pool_clean(llm.llm_engine)


def test_prefix_cache_hits_same_image_and_never_another(llava_dir: str) -> None:
    llm = LLM(llava_dir, dtype="float32", num_gpu_blocks=64, block_size=8)
    engine = llm.llm_engine
    prompt, specs = CASES[0]
    first = llm.generate(engine_prompt(prompt, specs), GREEDY, use_tqdm=False)[0]
    again = llm.generate(engine_prompt(prompt, specs), GREEDY, use_tqdm=False)[0]
    n = len(first.prompt_token_ids)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (n - 1) // 8 * 8  # every full block, through the image
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert (
        engine.runner.kind_part.num_encoder_runs == 1
    )  # the hit covered the image: not encoded again
    # Same text, another image: only the blocks before the image may be shared.
    offset = first.prompt_token_ids.index(engine.kind.image_token_id)
    assert first.prompt_token_ids.count(engine.kind.image_token_id) == TOKENS_PER_IMAGE
    other_specs = ((5, 40, 50),)
    other = llm.generate(engine_prompt(prompt, other_specs), GREEDY, use_tqdm=False)[0]
    assert other.prompt_token_ids == first.prompt_token_ids  # the token ids are the same
    assert other.num_cached_tokens == offset // 8 * 8
    eos = engine.eos_token_ids[0]
    assert strip_eos(list(other.outputs[0].token_ids), eos) == hf_greedy(
        llava_dir, prompt, other_specs
    )
    assert engine.runner.kind_part.num_encoder_runs == 2
    # The same image with other text after it: the hit ends inside the image, and the step
    # that follows computes the image's remaining rows from a fresh encoding.
    tail = ("USER: <image>Who is it? ASSISTANT:", specs)
    third = llm.generate(engine_prompt(*tail), GREEDY, use_tqdm=False)[0]
    assert offset < third.num_cached_tokens < offset + TOKENS_PER_IMAGE
    assert strip_eos(list(third.outputs[0].token_ids), eos) == hf_greedy(llava_dir, *tail)
    assert engine.runner.kind_part.num_encoder_runs == 3
    assert_pool_clean(engine)


def test_same_image_in_one_batch_is_encoded_once(llava_dir: str) -> None:
    llm = LLM(
        llava_dir, dtype="float32", num_gpu_blocks=64, block_size=8, enable_prefix_caching=False
    )
    cases = [CASES[0], ("Look: <image> it is a", CASES[0][1])]
    assert run(llm, cases) == [hf_greedy(llava_dir, *c) for c in cases]
    runner = llm.llm_engine.runner
    assert runner.kind_part.num_encoder_runs == 1
    assert (
        runner.kind_part.encoder_cache.num_hits == 1
        and runner.kind_part.encoder_cache.num_misses == 1
    )
    assert_pool_clean(llm.llm_engine)


def test_preempting_pool_recomputes_images(llava_dir: str) -> None:
    # 10 blocks of 8 tokens for four prompts of 23-51 tokens (+10 generated): preemptions.
    llm = LLM(
        llava_dir,
        dtype="float32",
        num_gpu_blocks=10,
        block_size=8,
        max_model_len=72,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    assert run(llm, CASES) == [hf_greedy(llava_dir, *c) for c in CASES]
    assert llm.llm_engine.scheduler.num_preemptions > 0
    # A preempted request lost its K/V: its images were embedded again when it came back.
    assert llm.llm_engine.runner.kind_part.num_encoder_runs > 4
    assert len(llm.llm_engine.runner.kind_part.encoder_cache) == 0
    assert_pool_clean(llm.llm_engine)


def test_bad_image_prompts_are_refused_by_name(llava_dir: str) -> None:
    llm = LLM(
        llava_dir,
        dtype="float32",
        num_gpu_blocks=16,
        block_size=8,
        max_model_len=128,
        limit_mm_per_prompt={"image": 1},
    )
    image = make_image(0, 10, 10)

    def refused(prompt: Any, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompt, GREEDY, use_tqdm=False)

    refused({"prompt": "no placeholder", "multi_modal_data": {"image": image}}, "1 image")
    refused(
        {"prompt": "<image> <image>", "multi_modal_data": {"image": [image, image]}},
        "more than the 1",
    )
    refused({"prompt": "<image>", "multi_modal_data": {"image": "cat.png"}}, "PIL.Image")
    refused({"prompt": "<image>", "multi_modal_data": {"audio": image}}, "images only")
    refused("<image> without an image", "no image was given")
    refused({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": image}}, "as text")
    assert_pool_clean(llm.llm_engine)


def test_text_only_model_refuses_images(tmp_path: Any) -> None:
    from tests.tiny_checkpoints import build_tiny_checkpoint

    llm = LLM(build_tiny_checkpoint(tmp_path), dtype="float32", num_gpu_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="takes text only; the prompt carries image"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": make_image(0, 8, 8)}})


def test_transformers_5_checkpoint_layout_loads(llava_dir: str, tmp_path: Any) -> None:
    """The other layout's names (`model.vision_tower.vision_model.*`, `model.language_model.*`,
    `lm_head.*`) load into the same model: same greedy tokens."""
    import shutil

    moved = tmp_path / "v5"
    shutil.copytree(llava_dir, moved)
    tensors = load_file(str(moved / "model.safetensors"))
    renamed = {}
    for name, tensor in tensors.items():
        ours = checkpoint_name(name)
        if ours.startswith("vision_tower."):
            new = "model.vision_tower.vision_model." + ours[len("vision_tower.") :]
        elif ours.startswith("model."):
            new = "model.language_model." + ours[len("model.") :]
        elif ours.startswith("multi_modal_projector."):
            new = "model." + ours
        else:
            new = ours
        assert checkpoint_name(new) == ours
        renamed[new] = tensor
    assert any(k.startswith("model.vision_tower.vision_model.") for k in renamed)
    save_file(renamed, str(moved / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(moved), dtype="float32", num_gpu_blocks=16, block_size=8, max_model_len=128)
    assert run(llm, CASES[:1]) == [hf_greedy(llava_dir, *CASES[0])]


def test_siglip_tower_equals_hf(tmp_path: Any) -> None:
    """A SigLIP tower (no class token, "full" strategy, last layer), chunks cutting images."""
    path = build_tiny_llava(str(tmp_path / "siglip"), tower="siglip")
    llm = LLM(
        path,
        dtype="float32",
        num_gpu_blocks=32,
        block_size=8,
        max_model_len=128,
        max_num_batched_tokens=12,
    )
    cases = CASES[:3]
    assert run(llm, cases) == [hf_greedy(path, *c) for c in cases]
    # (Its checkpoint has a pooling head and post_layernorm, skipped: LLaVA never reads them.)
    assert llm.llm_engine.runner.kind_part.num_encoder_runs == 3
    assert_pool_clean(llm.llm_engine)


def test_encoder_budget_of_one_image_per_step_equals_hf(llava_dir: str) -> None:
    """`max_num_encoder_input_tokens` = one image: every step runs the tower on one image at
    most, through chunks cutting images, an image twice in one prompt and one shared by two
    prompts; the answers are HF's and nothing stays held."""
    cases = [
        *CASES,
        ("Twice: <image> and <image> again", ((5, 30, 40), (5, 30, 40))),
        ("Look: <image> it is a", CASES[0][1]),
    ]
    llm = LLM(
        llava_dir,
        dtype="float32",
        num_gpu_blocks=64,
        block_size=8,
        max_num_batched_tokens=40,  # unbounded, some step would encode two images
        max_num_encoder_input_tokens=TOKENS_PER_IMAGE,
    )
    engine = llm.llm_engine
    model = engine.runner.kind_part.eager_model
    runs: list[int] = []  # images per tower run (one run per step)
    embed = model.embed_image_list

    def spy(pixels: Any, grids: Any) -> Any:
        runs.append(len(pixels))
        return embed(pixels, grids)

    model.embed_image_list = spy
    assert run(llm, cases) == [hf_greedy(llava_dir, *c) for c in cases]
    assert runs and max(runs) == 1
    assert len(engine.runner.kind_part.encoder_cache) == 0
    assert engine.scheduler.encoder_budget.num_held() == 0
    assert_pool_clean(engine)


def test_two_pipeline_stages_equal_hf(llava_dir: str) -> None:
    """Pipeline parallelism with a vision-language model: the first stage (the engine's
    process) holds the vision tower and embeds the images, the second only its decoder layer;
    chunks that cut images, on two virtual engines, give HF's tokens."""
    from tokenwise.models.clip_vision import CLIPVisionTower

    llm = LLM(
        llava_dir,
        dtype="float32",
        pipeline_parallel_size=2,
        num_gpu_blocks=128,
        block_size=8,
        max_num_batched_tokens=12,
    )
    try:
        assert run(llm, CASES) == [hf_greedy(llava_dir, *c) for c in CASES]
        runner = llm.llm_engine.runner
        assert isinstance(runner.model.vision_tower, CLIPVisionTower)
        assert runner.model.model.end_layer == 1  # the other layer is the second stage's
        assert runner.kind_part.num_encoder_runs == 4
        assert len(runner.kind_part.encoder_cache) == 0
        assert_pool_clean(llm.llm_engine)
    finally:
        llm.shutdown()
