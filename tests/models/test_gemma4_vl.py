"""Gemma 4 with images against Hugging Face: prompts with images give HF's greedy tokens and
logprobs, however the engine chunks or shares them.

The tiny checkpoints (`_tiny_gemma4_vl.py`) give each image its own number of soft tokens (up
to 70: the processor keeps the aspect ratio) and have sliding layers with a window of 8.
"vision" is the larger hub models' attention (an image's tokens attend both ways in the
sliding layers only); "causal" the small models' (no image rule, so chunks may cut images).
References are HF `generate` / forward (fp32) on the image processor's pixels and patch
positions, with the placeholders expanded as `Gemma4Processor` does (`<|image>`, one
`<|image|>` per soft token, `<image|>`; the processor itself needs torchvision) and its
`mm_token_type_ids` (the bidirectional image mask).
"""

from __future__ import annotations

import math
from functools import cache, partial
from typing import Any

import pytest
import torch
import transformers

from tests.engine._fixtures import assert_pool_clean
from tests.models._tiny_gemma4_vl import (
    BOI,
    EOI,
    IMAGE,
    build_tiny_gemma4_vl,
    gemma4_tokenizer,
    image_processor,
)
from tests.models._tiny_llava import make_image
from tests.models._vl_helpers import (
    Specs,
    check_prefix_hits_through_and_into_image,
    chunk_ends,
    engine_prompt,
    strip_eos,
)
from tokenwise.entrypoints.llm import LLM
from tokenwise.sampling.params import SamplingParams

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

# (prompt, image specs (seed, width, height)): one image, two of other shapes, text only.
CASES: list[tuple[str, Specs]] = [
    ("USER: <|image|> what is it? ASSISTANT:", ((0, 40, 50),)),
    ("The cat <|image|> and the dog <|image|> sat on", ((1, 70, 33), (2, 20, 24))),
    ("Hello world! Hello tokenwise, a small", ()),
]
# Five layers, one KV-cache group each (sliding and global pages differ).
POOL = 5 * 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_gemma4_vl(str(tmp_path_factory.mktemp("gemma4vl") / "ckpt"))


@pytest.fixture(scope="module")
def causal_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("gemma4vl-causal") / "ckpt")
    return build_tiny_gemma4_vl(out, bidirectional=None)


@cache
def hf_model(path: str) -> Any:
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def hf_inputs(prompt: str, specs: Specs) -> dict[str, torch.Tensor]:
    tok = gemma4_tokenizer()
    if not specs:
        return dict(tok(prompt, return_tensors="pt"))
    batch = image_processor()([make_image(*s) for s in specs], return_tensors="pt")
    pieces = prompt.split(IMAGE)
    text = pieces[0]
    for n, piece in zip(batch["num_soft_tokens_per_image"].tolist(), pieces[1:], strict=True):
        text += BOI + IMAGE * int(n) + EOI + piece
    inputs = dict(tok(text, return_tensors="pt"))
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == tok.convert_tokens_to_ids(IMAGE)).long()
    inputs["pixel_values"] = batch["pixel_values"]
    inputs["image_position_ids"] = batch["image_position_ids"]
    return inputs


@cache
def hf_greedy(path: str, prompt: str, specs: Specs) -> list[int]:
    inputs = hf_inputs(prompt, specs)
    with torch.no_grad():
        out = hf_model(path).generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    eos = gemma4_tokenizer().eos_token_id
    return strip_eos(out[0, inputs["input_ids"].shape[1] :].tolist(), eos)


def hf_first_logprobs(path: str, prompt: str, specs: Specs, image_mask: bool = True) -> Any:
    inputs = hf_inputs(prompt, specs)
    if not image_mask:
        inputs.pop("mm_token_type_ids")
    with torch.no_grad():
        return torch.log_softmax(hf_model(path)(**inputs).logits[0, -1], -1)


def run(llm: LLM, cases: list[tuple[str, Specs]]) -> list[list[int]]:
    outs = llm.generate([engine_prompt(*c) for c in cases], GREEDY, use_tqdm=False)
    eos = llm.llm_engine.eos_token_ids[0]
    return [strip_eos(list(o.outputs[0].token_ids), eos) for o in outs]


def cuts_an_image(ends: list[tuple[int, list[tuple[int, int]]]]) -> bool:
    return any(s < end < e for end, images in ends for s, e in images)


@pytest.mark.parametrize("budget", [512, 80], ids=["whole-prompts", "chunks-around-images"])
def test_mixed_batch_equals_hf(ckpt: str, budget: int) -> None:
    # A budget of 80 would end the first chunk of the two-image prompt inside an image.
    llm = LLM(
        ckpt, dtype="float32", num_gpu_blocks=POOL, block_size=8, max_num_batched_tokens=budget
    )
    ends = chunk_ends(llm)
    got = run(llm, CASES)
    assert got == [hf_greedy(ckpt, *c) for c in CASES]
    # The images steer the model: the same text with another image answers differently.
    other = [(CASES[0][0], ((9, 30, 30),))]
    assert run(llm, other) == [hf_greedy(ckpt, *other[0])] != [got[0]]
    if budget == 80:  # the prompts were chunked, and no chunk ended inside an image
        assert sum(1 for _, images in ends if images) > 3
        assert not cuts_an_image(ends)
    runner = llm.llm_engine.runner
    assert runner.kind_part.num_encoder_runs == 4
    assert len(runner.kind_part.encoder_cache) == 0
    assert_pool_clean(llm.llm_engine)


def test_prompt_expansion_equals_the_processors(ckpt: str) -> None:
    """Each image's soft-token count follows its aspect ratio (the image processor's count),
    and the expanded prompt tokenizes as HF's processor would write it."""
    llm = LLM(ckpt, dtype="float32", num_gpu_blocks=POOL, block_size=8)
    prompt, specs = CASES[1]
    ids, images = llm.llm_engine.kind.prompts.process(prompt, [make_image(*s) for s in specs])
    assert ids == hf_inputs(prompt, specs)["input_ids"][0].tolist()
    lengths = [im.length for im in images]
    assert len(set(lengths)) == 2 and max(lengths) <= 70
    boi = gemma4_tokenizer().convert_tokens_to_ids(BOI)
    assert [ids[im.offset - 1] for im in images] == [boi, boi]


def test_chunks_may_cut_images_without_the_image_rule(causal_ckpt: str) -> None:
    """The small models attend causally over images: a chunk may end inside one, and the
    tokens still equal HF's (the image's rows arrive chunk by chunk)."""
    llm = LLM(
        causal_ckpt, dtype="float32", num_gpu_blocks=POOL, block_size=8, max_num_batched_tokens=24
    )
    ends = chunk_ends(llm)
    assert run(llm, CASES[:2]) == [hf_greedy(causal_ckpt, *c) for c in CASES[:2]]
    assert cuts_an_image(ends)
    assert llm.llm_engine.runner.kind_part.num_encoder_runs == 3
    assert_pool_clean(llm.llm_engine)


@pytest.mark.parametrize("prefill", ["per_sequence", "packed"])
def test_first_logprobs_equal_hf_and_need_the_sliding_image_rule(
    ckpt: str, prefill: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first token's logprobs equal HF's (1e-4). HF without its image mask (causal over
    the images) is off by far more, and so is the engine with the image rule on every layer
    (Gemma 3's): Gemma 4's global layers stay causal. (No prefix cache: each run computes
    its prompt.) "packed" forces the GPU's one-call prefill on CPU."""
    if prefill == "packed":
        from tokenwise.attention.backends.torch_backend import TorchAttentionImpl

        monkeypatch.setattr(TorchAttentionImpl, "_prefill", TorchAttentionImpl._prefill_packed)
    llm = LLM(ckpt, dtype="float32", num_gpu_blocks=POOL, block_size=8, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    model = llm.llm_engine.runner.kind_part.eager_model

    def first_logprobs(prompt: str, specs: Specs) -> dict[int, float]:
        out = llm.generate(engine_prompt(prompt, specs), params, use_tqdm=False)[0]
        return {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}

    for prompt, specs in CASES[:2]:
        ref = hf_first_logprobs(ckpt, prompt, specs)
        got = first_logprobs(prompt, specs)
        assert len(got) >= 5
        for token, value in got.items():
            assert math.isclose(value, ref[token].item(), abs_tol=1e-4)
        causal = hf_first_logprobs(ckpt, prompt, specs, image_mask=False)
        assert (ref - causal).abs().max().item() > 1e-2  # the mask matters for this prompt
        sliding = model.bidirectional_image_layers
        model.bidirectional_image_layers = None  # every layer's metadata gets the spans
        try:
            everywhere = first_logprobs(prompt, specs)
        finally:
            model.bidirectional_image_layers = sliding
        assert max(abs(v - ref[t].item()) for t, v in everywhere.items()) > 1e-3
    assert_pool_clean(llm.llm_engine)


def test_prefix_cache_hits_through_and_into_images(ckpt: str) -> None:
    llm = LLM(ckpt, dtype="float32", num_gpu_blocks=POOL, block_size=8)
    prompt, specs = CASES[0]
    tail = ("USER: <|image|>Describe it. ASSISTANT:", specs)
    reference = partial(hf_greedy, ckpt)
    check_prefix_hits_through_and_into_image(llm, (prompt, specs), tail, reference, GREEDY)
    # The rest of the image ran from a fresh encoding.
    assert llm.llm_engine.runner.kind_part.num_encoder_runs == 2


def test_bad_inputs_are_refused_by_name(ckpt: str) -> None:
    llm = LLM(ckpt, dtype="float32", num_gpu_blocks=POOL, block_size=8, max_model_len=256)

    def refused(prompt: Any, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompt, GREEDY, use_tqdm=False)

    image = make_image(0, 40, 50)
    refused(
        {"prompt": "<|image|> hi", "multi_modal_data": {"image": torch.zeros(3, 8, 8)}},
        r"multi_modal_data\['image'\]\[0\] must be a PIL.Image.Image, got Tensor",
    )
    refused(
        {"prompt": "two? <|image|>", "multi_modal_data": {"image": [image, image]}},
        r"1 image placeholder\(s\) \('<\|image\|>'\) but 2 image\(s\)",
    )
    refused(
        {"prompt": "hear", "multi_modal_data": {"audio": (torch.zeros(160), 16000)}},
        "this model reads images only; multi_modal_data has audio",
    )
    refused(f"text with a bare {IMAGE}", "holds the image placeholder token but no image")
    assert run(llm, CASES[:1]) == [hf_greedy(ckpt, *CASES[0])]  # the engine still serves


def test_processor_and_tower_must_agree(ckpt: str, tmp_path: Any) -> None:
    """A processor cutting other patches than the tower reads is refused by name."""
    import shutil

    moved = tmp_path / "moved"
    shutil.copytree(ckpt, moved)
    transformers.Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2).save_pretrained(
        str(moved)
    )
    llm = LLM(str(moved), dtype="float32", num_gpu_blocks=POOL, block_size=8)
    with pytest.raises(ValueError, match="patch_size=4 but the vision tower's config says 2"):
        llm.generate(engine_prompt(*CASES[0]), GREEDY, use_tqdm=False)


def test_two_pipeline_stages_equal_hf(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pipeline parallelism: the first stage (sliding, global) embeds the images; the second
    (sliding, global, sliding, global) gets each prefill row's image spans in the step
    message and puts them on its sliding layers only: the first token's logprobs equal HF's
    (1e-4), which the rule on its first global layer would break (this checkpoint has six
    layers so that a global layer that is not the last one sits on the second stage)."""
    kinds = ["sliding_attention", "full_attention"] * 3
    out = str(tmp_path_factory.mktemp("gemma4vl-6") / "ckpt")
    ckpt = build_tiny_gemma4_vl(out, num_hidden_layers=6, layer_types=kinds)
    monkeypatch.setenv("TOKENWISE_PP_LAYER_PARTITION", "2,4")
    llm = LLM(
        ckpt,
        dtype="float32",
        pipeline_parallel_size=2,
        num_gpu_blocks=2 * POOL,
        block_size=8,
        max_num_batched_tokens=80,
    )
    try:
        assert run(llm, CASES) == [hf_greedy(ckpt, *c) for c in CASES]
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
        for prompt, specs in CASES[:2]:
            out = llm.generate(engine_prompt(prompt, specs), params, use_tqdm=False)[0]
            ref = hf_first_logprobs(ckpt, prompt, specs)
            for token, lp in out.outputs[0].logprobs[0].items():
                assert math.isclose(lp.logprob, ref[token].item(), abs_tol=1e-4)
        stage0 = llm.llm_engine.runner.model
        assert stage0.model.is_first_stage and not stage0.model.is_last_stage
        assert stage0.bidirectional_image_layers == {"model.layers.0.self_attn.attn"}
        assert_pool_clean(llm.llm_engine)
    finally:
        llm.shutdown()


def test_images_turned_off_serve_the_text_model_under_tensor_parallelism(ckpt: str) -> None:
    """`limit_mm_per_prompt={"image": 0}`: the hub checkpoint runs as its text model (no
    tower built, the generate kind), so tensor parallelism, refused for vision-language
    models, is taken again; its text answers stay HF's and an image is refused by name."""
    llm = LLM(
        ckpt,
        dtype="float32",
        num_gpu_blocks=POOL,
        block_size=8,
        max_model_len=256,
        limit_mm_per_prompt={"image": 0},
        tensor_parallel_size=2,
    )
    try:
        engine = llm.llm_engine
        assert engine.kind.name == "generate"
        names = [name for name, _ in engine.runner.model.named_parameters()]
        assert names and not [n for n in names if "vision" in n]
        assert run(llm, CASES[2:]) == [hf_greedy(ckpt, *CASES[2])]
        with pytest.raises(ValueError, match="takes text only"):
            llm.generate(engine_prompt(*CASES[0]), GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        LLM(ckpt, dtype="float32", num_gpu_blocks=POOL, tensor_parallel_size=2)
