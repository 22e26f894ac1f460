"""Qwen2.5-VL against Hugging Face: prompts with images of any size give HF's greedy tokens,
however the engine cuts, shares or recomputes them, and the 3-D (M-RoPE) positions are HF's.

The tiny checkpoint (`_tiny_qwen25vl.py`) turns a 40x56 image into a 5x7 grid of tokens cut
into 3x4 attention windows, a 70x33 one into 9x4 and a 20x24 one into 3x3. References are
HF `generate` (fp32) on the inputs of HF's `Qwen2_5_VLProcessor`. Each engine setting forces
one path: a token budget smaller than an image (chunks start and stop inside images), a
repeated image (prefix-cache hits through the image), the same text with another image (no
false sharing), and a pool too small for the batch (preemption, then recomputation).
"""

from __future__ import annotations

from typing import Any

import numpy as np
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
    hf_parts,
    images_of,
    record_image_cuts,
    rotate_like_hf,
    strip_eos,
)
from tests.models._tiny_llava import make_image
from tests.models._tiny_qwen25vl import IMAGE, build_tiny_qwen25vl
from tokenwise.engine.kinds.mrope_positions import prompt_mrope_positions
from tokenwise.entrypoints.llm import LLM

CASES: list[tuple[str, Specs]] = [
    ("USER: " + IMAGE + "What is in the picture? ASSISTANT:", ((0, 40, 56),)),
    ("The cat " + IMAGE + " and the dog " + IMAGE + " sat on the", ((1, 70, 33), (2, 20, 24))),
    ("Hello world! Hello tokenwise, a small", ()),
]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_qwen25vl(str(tmp_path_factory.mktemp("qwen25vl") / "ckpt"))


def run(llm: LLM, cases: list[tuple[str, Specs]]) -> list[list[int]]:
    outs = llm.generate([engine_prompt(*c) for c in cases], GREEDY, use_tqdm=False)
    eos = llm.llm_engine.eos_token_ids[0]
    return [strip_eos(list(o.outputs[0].token_ids), eos) for o in outs]


@pytest.mark.parametrize("budget", [512, 12], ids=["whole-prompts", "chunks-cut-images"])
def test_mixed_batch_equals_hf(qwen_dir: str, budget: int) -> None:
    llm = LLM(
        qwen_dir, dtype="float32", num_gpu_blocks=64, block_size=8, max_num_batched_tokens=budget
    )
    cuts = record_image_cuts(llm)
    outs = llm.generate([engine_prompt(*c) for c in CASES], GREEDY, use_tqdm=False)
    eos = llm.llm_engine.eos_token_ids[0]
    got = [strip_eos(list(o.outputs[0].token_ids), eos) for o in outs]
    assert got == [hf_greedy(qwen_dir, *c) for c in CASES]
    # The processor's expansion is HF's: same token ids, one run of placeholders per image.
    for out, case in zip(outs, CASES, strict=True):
        assert out.prompt_token_ids == hf_inputs(qwen_dir, *case)["input_ids"][0].tolist()
    assert any(cuts) == (budget == 12)
    # The images do steer the model: the same text with another image answers differently.
    other = [(CASES[0][0], ((9, 40, 56),))]
    assert run(llm, other) == [hf_greedy(qwen_dir, *other[0])] != [got[0]]
    runner = llm.llm_engine.runner
    assert runner.kind_part.num_encoder_runs == 4  # each distinct image once, however many chunks
    assert len(runner.kind_part.encoder_cache) == 0
    assert_pool_clean(llm.llm_engine)


def test_mrope_positions_equal_hf_get_rope_index(qwen_dir: str) -> None:
    """The prompt's 3-D positions and delta are HF's, for grids wider than tall and taller
    than wide; and they differ from 1-D positions (what the parity above rests on)."""
    model = hf_parts(qwen_dir)[0]
    llm = LLM(qwen_dir, dtype="float32", num_gpu_blocks=16, block_size=8, max_model_len=128)
    kind = llm.llm_engine.kind
    for prompt, specs in CASES[:2]:
        inputs = hf_inputs(qwen_dir, prompt, specs)
        want, delta = model.model.get_rope_index(
            inputs["input_ids"],
            mm_token_type_ids=inputs["mm_token_type_ids"],
            image_grid_thw=inputs["image_grid_thw"],
        )
        ids, images = kind.prompts.process(prompt, images_of(specs))
        got, got_delta = prompt_mrope_positions(len(ids), images, kind.merge_size)
        np.testing.assert_array_equal(got, want[:, 0].numpy())
        assert got_delta == int(delta) < 0
        assert not np.array_equal(got, np.broadcast_to(np.arange(len(ids)), got.shape))
        grids = {image.grid_thw[1] != image.grid_thw[2] for image in images}
        assert grids == {True}  # non-square: height and width axes differ


def test_mrope_layer_equals_hf_rotary() -> None:
    """`MRotaryEmbedding` on `[3, T]` positions rotates q and k as HF's M-RoPE does (bands of
    a head_dim-128 rotary taken from three different axes), and 1-D positions as plain RoPE."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf_qwen

    from tokenwise.layers.mrope import MRotaryEmbedding
    from tokenwise.layers.rotary_embedding import RotaryEmbedding

    section = [16, 24, 24]
    config = transformers.Qwen2_5_VLTextConfig(
        hidden_size=256,
        num_attention_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section},
    )
    hf_rope = hf_qwen.Qwen2_5_VLRotaryEmbedding(config)
    ours = MRotaryEmbedding(128, 512, 1e6, section)
    positions, q, k = rotate_like_hf(hf_qwen, hf_rope, ours, 128)
    flat = positions[0]
    plain = RotaryEmbedding(128, 512, 1e6)
    for a, b in zip(ours(flat, q, k), plain(flat, q, k), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ValueError, match="mrope_section"):
        MRotaryEmbedding(128, 512, 1e6, [16, 24, 16])


def test_vision_tower_equals_hf(qwen_dir: str) -> None:
    """The tower's rows for images of three sizes, run as one batch, are HF's
    `get_image_features` (windows, the full-attention block, 2-D rotary, merger)."""
    llm = LLM(qwen_dir, dtype="float32", num_gpu_blocks=16, block_size=8, max_model_len=128)
    assert_tower_equals_hf(qwen_dir, llm.llm_engine.runner.kind_part.eager_model)


def test_one_d_positions_would_not_equal_hf(qwen_dir: str) -> None:
    """The same engine fed 1-D positions (the model's fallback) answers otherwise: the parity
    tests could not pass without the 3-D positions."""
    llm = LLM(qwen_dir, dtype="float32", num_gpu_blocks=32, block_size=8, max_model_len=128)
    cases = CASES[:2]
    assert run(llm, cases) == [hf_greedy(qwen_dir, *c) for c in cases]
    llm.llm_engine.runner.kind_part.mrope_buffer = (
        None  # the model then rotates by the 1-D positions
    )
    flat = run(llm, cases)
    assert flat != [hf_greedy(qwen_dir, *c) for c in cases]


def test_prefix_cache_hits_same_image_and_never_another(qwen_dir: str) -> None:
    llm = LLM(qwen_dir, dtype="float32", num_gpu_blocks=64, block_size=8)
    engine = llm.llm_engine
    hits = engine.scheduler.block_manager
    prompt, specs = CASES[0]
    first = llm.generate(engine_prompt(prompt, specs), GREEDY, use_tqdm=False)[0]
    before = hits.prefix_cache_hits
    again = llm.generate(engine_prompt(prompt, specs), GREEDY, use_tqdm=False)[0]
    n = len(first.prompt_token_ids)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (n - 1) // 8 * 8  # every full block, through the image
    assert hits.prefix_cache_hits - before == again.num_cached_tokens
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert engine.runner.kind_part.num_encoder_runs == 1  # the hit covered the image
    # Same text, another image of the same size: only the blocks before the image are shared.
    image_id = engine.kind.image_token_id
    offset = first.prompt_token_ids.index(image_id)
    other_specs = ((5, 40, 56),)
    other = llm.generate(engine_prompt(prompt, other_specs), GREEDY, use_tqdm=False)[0]
    assert other.prompt_token_ids == first.prompt_token_ids
    assert other.num_cached_tokens == offset // 8 * 8
    eos = engine.eos_token_ids[0]
    assert strip_eos(list(other.outputs[0].token_ids), eos) == hf_greedy(
        qwen_dir, prompt, other_specs
    )
    # The same image with other text after it: the hit ends inside the image, and the rest of
    # the image (and its 3-D positions) is computed from there.
    tail = ("USER: " + IMAGE + "Who is it? ASSISTANT:", specs)
    third = llm.generate(engine_prompt(*tail), GREEDY, use_tqdm=False)[0]
    count = first.prompt_token_ids.count(image_id)
    assert offset < third.num_cached_tokens < offset + count
    assert strip_eos(list(third.outputs[0].token_ids), eos) == hf_greedy(qwen_dir, *tail)
    assert engine.runner.kind_part.num_encoder_runs == 3
    assert_pool_clean(engine)


def test_preempting_pool_equals_hf(qwen_dir: str) -> None:
    # 12 blocks of 8 tokens for prompts of 71, 62 and 23 tokens (+10 generated), prefilled
    # 16 tokens a step: preemptions, one of a request past its image.
    llm = LLM(
        qwen_dir,
        dtype="float32",
        num_gpu_blocks=12,
        block_size=8,
        max_model_len=96,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    assert run(llm, CASES) == [hf_greedy(qwen_dir, *c) for c in CASES]
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.runner.kind_part.num_encoder_runs > 3  # re-embedded after a preemption
    assert len(llm.llm_engine.runner.kind_part.encoder_cache) == 0
    assert_pool_clean(llm.llm_engine)


def test_bad_image_prompts_are_refused_by_name(qwen_dir: str) -> None:
    llm = LLM(qwen_dir, dtype="float32", num_gpu_blocks=16, block_size=8, max_model_len=128)
    image = make_image(0, 10, 10)
    with pytest.raises(ValueError, match="1 image"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": image}})
    with pytest.raises(ValueError, match="no image was given"):
        llm.generate("<|image_pad|> without an image", GREEDY, use_tqdm=False)
    # Video is Qwen3.5's only (test_qwen3_5_video.py): refused here by name.
    frames = np.zeros((2, 16, 16, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="reads images only; multi_modal_data has video"):
        llm.generate({"prompt": "<|video_pad|>", "multi_modal_data": {"video": frames}}, GREEDY)
    assert_pool_clean(llm.llm_engine)


def test_both_checkpoint_layouts_load(qwen_dir: str, tmp_path: Any) -> None:
    """`visual.*` / `model.*` (what transformers writes) and `model.visual.*` /
    `model.language_model.*` (the in-memory names of newer transformers) load into the same
    model: same greedy tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tokenwise.models.qwen2_5_vl import checkpoint_name

    moved = tmp_path / "renamed"
    shutil.copytree(qwen_dir, moved)
    tensors = load_file(str(moved / "model.safetensors"))
    assert any(k.startswith("visual.") for k in tensors)
    renamed = {}
    for name, tensor in tensors.items():
        if name.startswith("visual."):
            new = "model." + name
        elif name.startswith("model."):
            new = "model.language_model." + name[len("model.") :]
        else:
            new = name
        assert checkpoint_name(new) == name
        renamed[new] = tensor
    save_file(renamed, str(moved / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(moved), dtype="float32", num_gpu_blocks=16, block_size=8, max_model_len=128)
    assert run(llm, CASES[:1]) == [hf_greedy(qwen_dir, *CASES[0])]


def test_chat_image_parts_render_and_answer(qwen_dir: str) -> None:
    """A chat message's image parts go through the chat template to Qwen's placeholders, and
    the prompt with its images answers as HF does (what the server's chat route runs)."""
    from tokenwise.entrypoints.openai.chat_images import image_settings
    from tokenwise.entrypoints.openai.chat_rendering import render_chat
    from tokenwise.entrypoints.openai.protocol import ChatCompletionRequest

    llm = LLM(qwen_dir, dtype="float32", num_gpu_blocks=32, block_size=8, max_model_len=128)
    engine = llm.llm_engine
    image_token, limit = image_settings(engine)
    assert (image_token, limit) == ("<|image_pad|>", None)
    parts = [{"type": "text", "text": "Two:"}] + [
        {"type": "image_url", "image_url": {"url": u}} for u in ("data:,a", "data:,b")
    ]
    body = ChatCompletionRequest(messages=[{"role": "user", "content": parts}], model="m")
    prompt = render_chat(engine.tokenizer, body, image_token, 2)["prompt"]
    assert prompt == f"<|user|>Two:{IMAGE}{IMAGE}\n<|assistant|>"
    specs = CASES[1][1]
    assert run(llm, [(prompt, specs)]) == [hf_greedy(qwen_dir, prompt, specs)]


def test_engine_core_process_equals_hf(qwen_dir: str) -> None:
    """Behind an engine-core process (what `tokenwise serve` uses) the client processes the
    images and sends pixels, grids and 3-D positions: the answers are HF's, chunks cutting
    images included; a prompt the processor refuses fails in the caller, by name."""
    import time

    from tokenwise.engine.client import create_engine
    from tokenwise.engine.core_client import EngineCoreClient
    from tokenwise.engine.prompts import resolve_eos_token_ids
    from tokenwise.entrypoints.llm import build_engine_config

    config = build_engine_config(
        qwen_dir, dtype="float32", num_gpu_blocks=64, block_size=8, max_num_batched_tokens=12
    )
    engine = create_engine(config, core_process=True)
    try:
        assert isinstance(engine, EngineCoreClient)
        with pytest.raises(ValueError, match=r"0 image placeholder\(s\).*but 1 image"):
            engine.add_request("bad", {**engine_prompt(*CASES[0]), "prompt": "no image"}, GREEDY)
        for i, case in enumerate(CASES):
            engine.add_request(str(i), engine_prompt(*case), GREEDY)
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(CASES))}
        done: set[str] = set()
        deadline = time.monotonic() + 120
        while len(done) < len(CASES):
            assert time.monotonic() < deadline, "the core did not finish in 120 s"
            for out in engine.step():  # each output carries the step's new tokens
                tokens[out.request_id] += out.outputs[0].token_ids
                if out.finished:
                    done.add(out.request_id)
        eos = resolve_eos_token_ids(config.model, engine.tokenizer)[0]
        got = [strip_eos(tokens[str(i)], eos) for i in range(len(CASES))]
        assert got == [hf_greedy(qwen_dir, *c) for c in CASES]
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("budget", "chunked", "expected_runs"),
    [
        (45, True, [[0], [1, 2]]),  # the second prompt stops before its first image
        (20, True, [[0], [1], [2]]),  # images larger than the budget run alone
        (40, False, [[0], [1, 2]]),  # uncut, the second prompt waits, then runs whole (42)
    ],
    ids=["cut-before-image", "oversized-alone", "no-chunking"],
)
def test_encoder_budget_spreads_tower_runs_and_equals_hf(
    qwen_dir: str, budget: int, chunked: bool, expected_runs: list[list[int]]
) -> None:
    """`max_num_encoder_input_tokens`: no step encodes more image tokens than the budget
    (unless one image alone is larger), the deferred images run in later steps, and the
    answers are HF's. The images (CASES[0]'s, then CASES[1]'s two) are 35, 36 and 6 tokens;
    `expected_runs` names them by index."""
    llm = LLM(
        qwen_dir,
        dtype="float32",
        num_gpu_blocks=64,
        block_size=8,
        max_num_encoder_input_tokens=budget,
        enable_chunked_prefill=chunked,
    )
    engine = llm.llm_engine
    model = engine.runner.kind_part.eager_model
    runs: list[list[int]] = []  # image tokens of each tower run (one run per step)
    embed = model.embed_image_list

    def spy(pixels: Any, grids: Any) -> Any:
        runs.append([model.tokens_per_image(grid) for grid in grids])
        return embed(pixels, grids)

    model.embed_image_list = spy
    sizes = [
        image.length
        for case in CASES[:2]
        for image in engine.kind.prompts.process(case[0], images_of(case[1]))[1]
    ]
    assert sizes == [35, 36, 6]
    assert run(llm, CASES) == [hf_greedy(qwen_dir, *c) for c in CASES]
    # Over the budget only alone: one image, or (chunking off) one prompt's images.
    per_prompt = [sizes[:1], sizes[1:]]
    assert all(sum(r) <= budget or len(r) == 1 or (not chunked and r in per_prompt) for r in runs)
    assert runs == [[sizes[i] for i in run_] for run_ in expected_runs]
    assert len(engine.runner.kind_part.encoder_cache) == 0
    assert engine.scheduler.encoder_budget.num_held() == 0
    assert_pool_clean(engine)


def test_max_num_encoder_input_tokens_is_checked(qwen_dir: str) -> None:
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens must be an integer >= 1"):
        LLM(qwen_dir, max_num_encoder_input_tokens=0)


def test_encoder_budget_with_preemption_and_shared_images_equals_hf(qwen_dir: str) -> None:
    """The budget's view of which images need the tower follows the runner's cache through
    chunks cutting images, a shared image, prefix-cache hits and preemptions: no step encodes
    more than the budget (bar one image alone), and the answers are HF's."""
    cases = [*CASES, ("USER: " + IMAGE + "Who is it? ASSISTANT:", CASES[0][1])]
    llm = LLM(
        qwen_dir,
        dtype="float32",
        num_gpu_blocks=12,
        block_size=8,
        max_model_len=96,
        max_num_batched_tokens=64,  # unbounded, the tower would run 36 + 6 in one step
        max_num_encoder_input_tokens=36,
    )
    engine = llm.llm_engine
    model = engine.runner.kind_part.eager_model
    runs: list[list[int]] = []
    embed = model.embed_image_list

    def spy(pixels: Any, grids: Any) -> Any:
        runs.append([model.tokens_per_image(grid) for grid in grids])
        return embed(pixels, grids)

    model.embed_image_list = spy
    assert run(llm, cases) == [hf_greedy(qwen_dir, *c) for c in cases]
    assert engine.scheduler.num_preemptions > 0
    assert all(sum(r) <= 36 for r in runs)
    assert {t for r in runs for t in r} == {6, 35, 36}  # every image ran
    assert len(engine.runner.kind_part.encoder_cache) == 0
    assert engine.scheduler.encoder_budget.num_held() == 0
    assert_pool_clean(engine)


def test_two_pipeline_stages_equal_hf(qwen_dir: str) -> None:
    """Pipeline parallelism: the first stage holds the vision tower and embeds the images;
    the second gets each step's 3-D (M-RoPE) positions in the step message. Chunks that cut
    images, on two virtual engines, give HF's tokens."""
    llm = LLM(
        qwen_dir,
        dtype="float32",
        pipeline_parallel_size=2,
        num_gpu_blocks=128,
        block_size=8,
        max_num_batched_tokens=12,
    )
    try:
        assert run(llm, CASES) == [hf_greedy(qwen_dir, *c) for c in CASES]
        runner = llm.llm_engine.runner
        assert runner.model.model.end_layer == 1  # the other layer is the second stage's
        assert runner.kind_part.num_encoder_runs == 3
        assert_pool_clean(llm.llm_engine)
    finally:
        llm.shutdown()
