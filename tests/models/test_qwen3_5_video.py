"""Qwen3.5 with videos against Hugging Face: greedy tokens equal HF's `generate` on the same
`pixel_values_videos` / `video_grid_thw` (fp32), however the engine cuts or caches them.

The tiny checkpoint (`_tiny_qwen35vl.py`, no video processor config: the image processor's
sizes) turns 4 frames of 40x56 into 2 temporal groups of 24x32 pixels (4 x 40 x 56 pixels
exceed its 4096 budget), so 2 x 12 tokens, each group behind its timestamp. HF's video
processor needs torchvision (not installed), so the preprocessing is checked against what HF
defines it by: its image processor (a still video of two equal frames is an image), its
video patchify, and Qwen3-VL's frame-count-aware resize.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest
import torch

from tests.models._grid_vl import GREEDY, hf_parts, images_of, record_image_cuts, strip_eos
from tests.models._tiny_qwen25vl import IMAGE
from tests.models._tiny_qwen35vl import build_tiny_qwen35vl
from tokenwise.engine.kinds.video_inputs import VideoSettings, patchify, process_video, smart_resize
from tokenwise.entrypoints.llm import LLM
from tokenwise.models.image_merge import images_turned_off

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
ONE_VIDEO = "USER: " + VIDEO + "What happens? ASSISTANT:"
WITH_IMAGE = "A picture " + IMAGE + " and a clip " + VIDEO + " show the"
GROUP = "<|vision_start|>" + "<|video_pad|>" * 12 + "<|vision_end|>"  # 24x32 px: 3x4 tokens


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_qwen35vl(str(tmp_path_factory.mktemp("qwen35video") / "ckpt"))


@pytest.fixture(scope="module")
def llm(path: str) -> LLM:
    """A token budget of 12: chunks start and stop inside the video's groups."""
    return LLM(path, dtype="float32", num_gpu_blocks=96, block_size=8, max_num_batched_tokens=12)


def make_video(seed: int, frames: int = 4, width: int = 56, height: int = 40) -> np.ndarray:
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (frames, height // 4, width // 4, 3), dtype=np.uint8)
    return np.repeat(np.repeat(coarse, 4, axis=1), 4, axis=2)


def settings(path: str) -> VideoSettings:
    return VideoSettings.of_checkpoint(path, hf_parts(path)[1].image_processor)


def hf_greedy(path: str, ids: list[int], video: np.ndarray, image_specs: Any = ()) -> list[int]:
    """HF's `generate` on the engine's token ids, with this module's video patches."""
    model, processor = hf_parts(path)
    processed = process_video(settings(path), (video, {"fps": 2.0}), 0)
    input_ids = torch.tensor([ids])
    types = torch.zeros_like(input_ids)
    types[input_ids == model.config.image_token_id] = 1
    types[input_ids == model.config.video_token_id] = 2
    inputs: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": types,
        "pixel_values_videos": processed.pixel_values,
        "video_grid_thw": torch.tensor([processed.grid_thw]),
    }
    if image_specs:
        inputs.update(processor.image_processor(images=images_of(image_specs), return_tensors="pt"))
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=GREEDY.max_tokens)
    return strip_eos(out[0, len(ids) :].tolist(), model.config.text_config.eos_token_id)


def run(llm: LLM, prompt: str, video: np.ndarray, images: Any = ()) -> Any:
    data: dict[str, Any] = {"video": (video, {"fps": 2.0})}
    if images:
        data["image"] = images_of(images)
    (out,) = llm.generate({"prompt": prompt, "multi_modal_data": data}, GREEDY, use_tqdm=False)
    return out


def video_token(llm: LLM) -> int:
    return int(llm.llm_engine.tokenizer.convert_tokens_to_ids("<|video_pad|>"))


def tokens(llm: LLM, out: Any) -> list[int]:
    return strip_eos(list(out.outputs[0].token_ids), llm.llm_engine.eos_token_ids[0])


def test_video_equals_hf_through_chunks_and_prefix_hits(path: str, llm: LLM) -> None:
    """One video: its placeholder becomes two timestamped groups (frames 0-1 at 0.25 s, 2-3 at
    1.25 s, printed to one decimal); greedy tokens are HF's with chunks of 12 tokens cutting
    the groups; the repeated prompt hits the prefix cache through the video (no new
    encoding); another video with the same text answers otherwise, as HF does."""
    engine = llm.llm_engine
    cuts = record_image_cuts(llm)
    video = make_video(0)
    first = run(llm, ONE_VIDEO, video)
    assert sum(cuts) >= 2  # chunks stopped inside the groups
    text = ONE_VIDEO.replace(VIDEO, "<0.2 seconds>" + GROUP + "<1.2 seconds>" + GROUP)
    assert first.prompt_token_ids == engine.tokenizer(text)["input_ids"]
    want = hf_greedy(path, first.prompt_token_ids, video)
    assert tokens(llm, first) == want
    runs = engine.runner.kind_part.num_encoder_runs
    assert runs == 2  # one per temporal group
    again = run(llm, ONE_VIDEO, video)
    ids = first.prompt_token_ids
    video_end = max(i for i, t in enumerate(ids) if t == video_token(llm)) + 1
    assert again.num_cached_tokens > video_end
    assert tokens(llm, again) == want
    assert engine.runner.kind_part.num_encoder_runs == runs
    other = run(llm, ONE_VIDEO, make_video(7))
    assert tokens(llm, other) == hf_greedy(path, other.prompt_token_ids, make_video(7))
    assert tokens(llm, other) != want


def test_video_and_image_in_one_prompt_equal_hf(path: str, llm: LLM) -> None:
    """An image then a 3-frame video (its last frame repeated into the second group): both
    runs of placeholders, their 3-D positions and rows are HF's."""
    video = make_video(3, frames=3, width=24, height=20)
    out = run(llm, WITH_IMAGE, video, ((2, 20, 24),))
    assert tokens(llm, out) == hf_greedy(path, out.prompt_token_ids, video, ((2, 20, 24),))
    ids = out.prompt_token_ids
    # 20x24 pixels become 16x24 (20 / 8 rounds half to even) for the image and the video: 2x3.
    assert ids.count(llm.llm_engine.kind.image_token_id) == 6
    assert ids.count(video_token(llm)) == 2 * 6


def test_preprocessing_is_hfs(path: str) -> None:
    """A still video of two equal frames gives HF's image processor's patches for the frame;
    the temporal layout is HF's video patchify; Qwen3-VL's resize budgets all frames."""
    # The module itself imports without torchvision; the lazy package's attribute does not.
    hf_video = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl")

    s = settings(path)
    image = images_of(((2, 20, 24),))[0]
    frames = np.stack([np.asarray(image)] * 2)
    got = process_video(s, frames, 0)
    want = hf_parts(path)[1].image_processor(images=[image], return_tensors="pt")
    assert got.grid_thw == tuple(want["image_grid_thw"][0].tolist())
    torch.testing.assert_close(got.pixel_values, want["pixel_values"], atol=1e-5, rtol=1e-5)
    video = np.random.default_rng(0).standard_normal((3, 16, 24, 3)).astype(np.float32)
    flat, grid = patchify(video, s)
    hf_flat, *hf_grid = hf_video.Qwen3VLVideoProcessor.patchify(
        None, torch.from_numpy(video).permute(0, 3, 1, 2)[None], 4, 2, 2
    )
    assert grid == tuple(hf_grid) == (2, 4, 6)
    torch.testing.assert_close(torch.from_numpy(flat), hf_flat[0])
    # Qwen3-VL's resize budgets all frames: 8 frames of 40x56 are cut to 16x24 (8 x 16 x 24
    # <= 4096 pixels), 2 frames to 32x48.
    assert process_video(s, make_video(1, frames=8), 0).grid_thw == (4, 4, 6)
    assert process_video(s, make_video(1, frames=2), 0).grid_thw == (1, 8, 12)
    for frames, height, width in ((8, 40, 56), (3, 20, 24), (2, 5, 300), (5, 100, 90)):
        want_hw = hf_video.smart_resize(frames, height, width, 2, 8, s.min_pixels, s.max_pixels)
        assert smart_resize(s, frames, height, width) == want_hw


def test_bad_videos_are_refused_by_name(path: str, llm: LLM) -> None:
    video = make_video(0)
    cases = [
        (video.astype(np.float32), r"\['video'\]\[0\] must have dtype uint8"),
        (video[..., :2], r"\['video'\]\[0\] must have shape \(frames, height, width, 3\)"),
        (video[:1], r"at least 2 frames \(temporal_patch_size\), got 1"),
        ("clip.mp4", r"\['video'\]\[0\] must be a \(frames, height, width, 3\) uint8"),
    ]
    for data, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate({"prompt": ONE_VIDEO, "multi_modal_data": {"video": data}}, GREEDY)
    with pytest.raises(ValueError, match=r"1 video placeholder.*but 2 video\(s\)"):
        llm.generate({"prompt": ONE_VIDEO, "multi_modal_data": {"video": [video, video]}}, GREEDY)
    with pytest.raises(ValueError, match="video placeholder token but no video"):
        llm.generate(ONE_VIDEO, GREEDY)
    limited = LLM(
        path,
        dtype="float32",
        num_gpu_blocks=16,
        block_size=8,
        max_model_len=128,
        limit_mm_per_prompt={"video": 0},
    )
    with pytest.raises(
        ValueError, match=r"1 videos, more than the 0.*limit_mm_per_prompt\['video'\]"
    ):
        limited.generate({"prompt": ONE_VIDEO, "multi_modal_data": {"video": video}}, GREEDY)


def test_a_video_limit_keeps_the_tower() -> None:
    """`{"image": 0}` alone is the text-model mode; a video limit above 0 needs the tower."""
    assert images_turned_off({"image": 0}) and images_turned_off({"image": 0, "video": 0})
    assert not images_turned_off({"image": 0, "video": 1})
