"""Gemma 3 with images against Hugging Face: prompts with images give HF's greedy tokens and
logprobs, however the engine chunks, shares or recomputes them.

The tiny checkpoint (`_tiny_gemma3_vl.py`) has 16 soft tokens per image and sliding layers
with a window of 8. References are HF `generate` (fp32) on the inputs of the checkpoint's own
processor, with its `token_type_ids` (the bidirectional image mask). Each engine setting
forces one path: a token budget that would cut every image (the scheduler moves the chunk
boundary before it), a repeated image (prefix-cache hits through and into the image), a pool
too small for the batch (preemption, recomputation). One test pins the mask itself: with a
causal mask over the images the logprobs would be off by far more than the tolerance.
"""

from __future__ import annotations

import math
from functools import cache, partial
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.engine._fixtures import assert_pool_clean
from tests.models._tiny_gemma3_vl import build_tiny_gemma3_vl
from tests.models._tiny_llava import make_image
from tests.models._vl_helpers import (
    Specs,
    check_prefix_hits_through_and_into_image,
    chunk_ends,
    engine_prompt,
    strip_eos,
)
from tokenwise.entrypoints.llm import LLM
from tokenwise.models.llava import checkpoint_name
from tokenwise.sampling.params import SamplingParams

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

# (prompt, image specs (seed, width, height)): one image, two, text only, an image first.
CASES: list[tuple[str, Specs]] = [
    ("USER: <start_of_image> what is it? ASSISTANT:", ((0, 40, 50),)),
    ("The cat <start_of_image> and the dog <start_of_image> sat on", ((1, 70, 33), (2, 20, 24))),
    ("Hello world! Hello tokenwise, a small", ()),
    ("<start_of_image>def fibonacci(n):", ((3, 64, 64),)),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_gemma3_vl(str(tmp_path_factory.mktemp("gemma3vl") / "ckpt"))


@cache
def hf_parts(path: str) -> tuple[Any, Any]:
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    processor = transformers.AutoProcessor.from_pretrained(path, backend="pil")
    return model.eval(), processor


# The tiny Gemma 3 has one global and two sliding layers, each a KV-cache group of its own
# (tokenwise.kv_cache.layout): a block is one layer's page, so 3 * 64 blocks are the memory 64
# blocks were when a block held all three layers.
POOL = 3 * 64


def hf_inputs(path: str, prompt: str, specs: Specs) -> Any:
    _, processor = hf_parts(path)
    images = [make_image(*s) for s in specs] or None
    return processor(images=images, text=prompt, return_tensors="pt")


@cache
def hf_greedy(path: str, prompt: str, specs: Specs) -> list[int]:
    model, _ = hf_parts(path)
    inputs = hf_inputs(path, prompt, specs)
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    eos = model.config.text_config.eos_token_id
    return strip_eos(out[0, inputs["input_ids"].shape[1] :].tolist(), eos)


def run(llm: LLM, cases: list[tuple[str, Specs]]) -> list[list[int]]:
    outs = llm.generate([engine_prompt(*c) for c in cases], GREEDY, use_tqdm=False)
    eos = llm.llm_engine.eos_token_ids[0]
    return [strip_eos(list(o.outputs[0].token_ids), eos) for o in outs]


@pytest.mark.parametrize("budget", [512, 20], ids=["whole-prompts", "chunks-around-images"])
def test_mixed_batch_equals_hf(ckpt: str, budget: int) -> None:
    # A budget of 20 would end the first chunk of every image prompt inside its image.
    llm = LLM(
        ckpt, dtype="float32", num_gpu_blocks=POOL, block_size=8, max_num_batched_tokens=budget
    )
    ends = chunk_ends(llm)
    got = run(llm, CASES)
    assert got == [hf_greedy(ckpt, *c) for c in CASES]
    # The images do steer the model: the same text with another image answers differently.
    other = [(CASES[0][0], ((9, 30, 30),))]
    assert run(llm, other) == [hf_greedy(ckpt, *other[0])] != [got[0]]
    if budget == 20:  # prompts were chunked, and no chunk ended inside an image
        prefill_ends = [end for end, images in ends if images]
        assert len(prefill_ends) > 5
        assert not any(s < end < e for end, images in ends for s, e in images)
    runner = llm.llm_engine.runner
    assert runner.kind_part.num_encoder_runs == 5
    assert len(runner.kind_part.encoder_cache) == 0
    assert_pool_clean(llm.llm_engine)


@pytest.mark.parametrize("prefill", ["per_sequence", "packed"])
def test_first_logprobs_equal_hf_and_need_the_image_mask(
    ckpt: str, prefill: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's logprobs of the first generated token equal HF's (1e-4); HF without its
    image mask (token_type_ids dropped: causal over the images) is off by far more. "packed"
    forces the GPU's one-call prefill on CPU."""
    if prefill == "packed":
        from tokenwise.attention.backends.torch_backend import TorchAttentionImpl

        monkeypatch.setattr(TorchAttentionImpl, "_prefill", TorchAttentionImpl._prefill_packed)
    llm = LLM(ckpt, dtype="float32", num_gpu_blocks=POOL, block_size=8, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    model, _ = hf_parts(ckpt)
    for prompt, specs in CASES[:2]:
        out = llm.generate(engine_prompt(prompt, specs), params, use_tqdm=False)[0]
        got = out.outputs[0].logprobs[0]
        inputs = hf_inputs(ckpt, prompt, specs)
        causal = {k: v for k, v in inputs.items() if k != "token_type_ids"}
        with torch.no_grad():
            ref = torch.log_softmax(model(**inputs).logits[0, -1], -1)
            wrong = torch.log_softmax(model(**causal).logits[0, -1], -1)
        assert len(got) >= 5
        for token, lp in got.items():
            value = lp.logprob if hasattr(lp, "logprob") else lp
            assert math.isclose(value, ref[token].item(), abs_tol=1e-4)
        assert (ref - wrong).abs().max().item() > 1e-2  # the mask matters for this prompt
    assert_pool_clean(llm.llm_engine)


def test_prefix_cache_hits_through_and_into_images(ckpt: str) -> None:
    llm = LLM(ckpt, dtype="float32", num_gpu_blocks=POOL, block_size=8)
    prompt, specs = CASES[0]
    tail = ("USER: <start_of_image> who is this? ASSISTANT:", specs)
    reference = partial(hf_greedy, ckpt)
    check_prefix_hits_through_and_into_image(llm, (prompt, specs), tail, reference, GREEDY)


def test_preempting_pool_recomputes_images(ckpt: str) -> None:
    llm = LLM(
        ckpt,
        dtype="float32",
        # One global and two sliding groups of one layer each: a 72-token sequence holds 9
        # blocks in the global group and at most 6 (its 32-token chunk and 8-token window) in
        # each sliding one, 21 in all; two blocks more, so that the four requests preempt.
        num_gpu_blocks=21 + 2,
        block_size=8,
        max_model_len=72,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    # This order makes the one-image prompt the victim after its image was computed.
    cases = [CASES[i] for i in (2, 0, 3, 1)]
    assert run(llm, cases) == [hf_greedy(ckpt, *c) for c in cases]
    assert llm.llm_engine.scheduler.num_preemptions > 0
    # A preempted request lost its K/V: its image was embedded again when it came back.
    assert llm.llm_engine.runner.kind_part.num_encoder_runs > 4
    assert_pool_clean(llm.llm_engine)


def test_image_longer_than_the_budget_is_refused(ckpt: str) -> None:
    llm = LLM(
        ckpt,
        dtype="float32",
        num_gpu_blocks=3 * 16,
        block_size=8,
        max_model_len=64,
        max_num_batched_tokens=12,
    )
    with pytest.raises(ValueError, match="max_num_batched_tokens=12"):
        llm.generate(engine_prompt(*CASES[0]), GREEDY, use_tqdm=False)
    assert run(llm, CASES[2:3]) == [hf_greedy(ckpt, *CASES[2])]  # text still runs, chunked


def v4_name(ours: str) -> str:
    """Published Gemma 3 checkpoints (transformers 4.x)."""
    if ours.startswith("vision_tower."):
        return "vision_tower.vision_model." + ours[len("vision_tower.") :]
    if ours.startswith(("model.", "lm_head.")):
        return "language_model." + ours
    return ours


def v5_name(ours: str) -> str:
    """transformers 5.x's module names."""
    if ours.startswith("model."):
        return "model.language_model." + ours[len("model.") :]
    if ours.startswith(("vision_tower.", "multi_modal_projector.")):
        return "model." + ours
    return ours


@pytest.mark.parametrize("rename", [v4_name, v5_name], ids=["4.x", "5.x"])
def test_checkpoint_layouts_load(ckpt: str, tmp_path: Any, rename: Any) -> None:
    """Either layout's names load into the same model: same greedy tokens."""
    import shutil

    moved = tmp_path / "moved"
    shutil.copytree(ckpt, moved)
    renamed = {}
    for name, tensor in load_file(str(moved / "model.safetensors")).items():
        ours = checkpoint_name(name)
        new = rename(ours)
        assert checkpoint_name(new) == ours
        renamed[new] = tensor
    assert len({n.split(".")[0] for n in renamed}) >= (2 if rename is v5_name else 3)
    save_file(renamed, str(moved / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(moved), dtype="float32", num_gpu_blocks=3 * 16, block_size=8, max_model_len=128)
    assert run(llm, CASES[:1]) == [hf_greedy(ckpt, *CASES[0])]


def test_two_pipeline_stages_equal_hf(ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipeline parallelism: the first stage embeds the images, the second (two of the three
    layers: the last layer's mask cannot reach the last token) gets each prefill row's image
    spans (both-ways attention inside an image) in the step message."""
    monkeypatch.setenv("TOKENWISE_PP_LAYER_PARTITION", "1,2")
    llm = LLM(
        ckpt,
        dtype="float32",
        pipeline_parallel_size=2,
        num_gpu_blocks=2 * POOL,
        block_size=8,
        max_num_batched_tokens=20,
    )
    try:
        assert run(llm, CASES) == [hf_greedy(ckpt, *c) for c in CASES]
        # The first token's logprobs: without the spans on the second stage (causal over the
        # images there) they are off by more than 1e-4 (the mask matters for these prompts).
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
        model, _ = hf_parts(ckpt)
        for prompt, specs in CASES[:2]:
            out = llm.generate(engine_prompt(prompt, specs), params, use_tqdm=False)[0]
            with torch.no_grad():
                logits = model(**hf_inputs(ckpt, prompt, specs)).logits[0, -1]
                ref = torch.log_softmax(logits, -1)
            for token, lp in out.outputs[0].logprobs[0].items():
                assert math.isclose(lp.logprob, ref[token].item(), abs_tol=1e-4)
        stage0 = llm.llm_engine.runner.model.model
        assert stage0.is_first_stage and not stage0.is_last_stage
        assert_pool_clean(llm.llm_engine)
    finally:
        llm.shutdown()
