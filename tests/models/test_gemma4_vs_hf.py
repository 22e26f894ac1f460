"""Gemma 4 against transformers on tiny checkpoints.

Three shapes (tests/tiny_checkpoints.py): "dense" is the 31B model's (global layers with twice
the head size and one KV head that is also the value, proportional RoPE); "e" adds what the
E2B/E4B models have (per-layer embeddings, the last two layers reading earlier layers' KV
cache, double-width MLPs there); "moe" the 26B-A4B model's routed experts beside each MLP. Prompts run far past the 8-token window through the engine's
paths that move window boundaries: chunked prefill with a 16-token budget, a pool small enough
to preempt, a second pass that hits the prefix cache, and two tensor-parallel ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine._fixtures import assert_pool_clean, checkpoint, hf_greedy, mixed_prompts
from tests.models.test_moe_models_vs_hf import _hf_logits, _load, _logits
from tests.tiny_checkpoints import tiny_tokenizer
from tokenwise import LLM, SamplingParams
from tokenwise.attention.layer import Attention

ARCH = "Gemma4ForCausalLM"
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SHAPES: dict[str, dict[str, Any]] = {
    "dense": {},
    "e": {
        "attention_k_eq_v": False,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": len(tiny_tokenizer()),
        "num_kv_shared_layers": 2,
        "use_double_wide_mlp": True,
    },
    # The 26B-A4B model's block: 4 GeGLU experts (top 2) beside every dense MLP.
    "moe": {
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
    },
}


def _ids(n: int = 40) -> torch.Tensor:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_match_hf_past_the_window(shape: str) -> None:
    path = checkpoint(ARCH, **SHAPES[shape])
    model, ids = _load(path), _ids()
    with torch.no_grad():
        torch.testing.assert_close(_logits(model, ids), _hf_logits(path, ids), atol=1e-4, rtol=0)


def test_layers_declare_their_window_head_size_and_kv_owner() -> None:
    """Sliding layers declare the window (their KV group frees what left it); global layers
    have the wider head; in "e" the last two layers own no cache (they read layers 1 and 2)."""
    dense = _load(checkpoint(ARCH))
    shapes = [(a.sliding_window, a.head_size, a.num_kv_heads) for a in _attns(dense)]
    assert shapes == [(8, 16, 2), (8, 16, 2), (None, 32, 1), (8, 16, 2), (None, 32, 1)]
    e = _load(checkpoint(ARCH, **SHAPES["e"]))
    names = [a.layer_name for a in _attns(e)]
    assert names == [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2)]
    owners = [layer.self_attn._producer for layer in e.model.layers]
    # Layers are s s f | s f: each sharer reads the last owner of its type (HF's "store").
    assert owners[3] == [e.model.layers[1].self_attn]
    assert owners[4] == [e.model.layers[2].self_attn]


def _attns(model: torch.nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def test_layer_scalars_and_per_layer_embeddings_change_the_logits() -> None:
    """The tiny checkpoint's layer scalars and per-layer embeddings are not neutral: HF with
    them reset gives other logits, so matching HF above means both are applied."""
    from transformers import AutoModelForCausalLM

    path, ids = checkpoint(ARCH, **SHAPES["e"]), _ids()
    ref = _hf_logits(path, ids)
    for reset in ("layer_scalar", "embed_tokens_per_layer"):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            if reset == "layer_scalar":
                for layer in hf.model.layers:
                    layer.layer_scalar.fill_(1.0)
            else:
                hf.model.embed_tokens_per_layer.weight.zero_()
            assert (hf(ids[None]).logits[0] - ref).abs().max() > 0.1, reset


def _engine_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_pool_clean(llm.llm_engine)
    return [list(o.outputs[0].token_ids) for o in outputs]


SCHEDULES = {
    "default": {},
    "chunked-16": {"max_num_batched_tokens": 16},
    # Chunks of 16 and a pool a few blocks above one 192-token sequence: the 18 prompts
    # preempt each other.
    "preempt-chunked-16": {"max_model_len": 192, "max_num_batched_tokens": 16},
}
SMALL_POOL = {"dense": 24, "e": 24, "moe": 24}
# The six prompts of the TP test need a tighter pool to preempt: one 192-token sequence
# (12 blocks in each global layer's group) and little more.
TP_POOL = 16


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_tokens_match_hf_under_every_schedule(shape: str, schedule: str) -> None:
    """All 18 mixed prompts (1..95 tokens, four sharing a 40-token prefix) equal HF's greedy
    tokens; a second pass over them hits the prefix cache and gives the same tokens."""
    path = checkpoint(ARCH, **SHAPES[shape])
    prompts = mixed_prompts()
    refs = [hf_greedy(path, p, MAX_TOKENS) for p in prompts]
    kwargs: dict[str, Any] = {"num_gpu_blocks": 256, **SCHEDULES[schedule]}
    if schedule.startswith("preempt"):
        kwargs["num_gpu_blocks"] = SMALL_POOL[shape]
    llm = LLM(path, dtype="float32", seed=0, **kwargs)
    for attempt in ("first", "second"):
        got = _engine_tokens(llm, prompts)
        for i, (tokens, want) in enumerate(zip(got, refs, strict=True)):
            assert tokens == want, f"{shape}/{schedule} {attempt} pass: prompt {i}"
        if attempt == "first":
            hits = llm.llm_engine.get_stats().prefix_cache_hits
            assert hits > 0, "the shared prefix should hit the cache"
    assert llm.llm_engine.get_stats().prefix_cache_hits > hits, "the second pass should hit"
    if schedule.startswith("preempt"):
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the small pool should preempt"


# Every feature at once, for the (slow) two-process test: k=v global layers with one KV head,
# per-layer embeddings, KV sharing, double-width MLPs and routed experts.
EVERYTHING = {**SHAPES["e"], **SHAPES["moe"], "attention_k_eq_v": True}


def test_tensor_parallel_2_gives_hf_tokens() -> None:
    """Two ranks: query heads split, the global layers' single KV head replicated, the
    per-layer embedding table split by vocabulary, each expert's intermediate rows split;
    chunked and preempting."""
    path = checkpoint(ARCH, **EVERYTHING)
    prompts = mixed_prompts()[::3]
    llm = LLM(
        path,
        dtype="float32",
        tensor_parallel_size=2,
        max_model_len=192,
        max_num_batched_tokens=16,
        num_gpu_blocks=TP_POOL,
    )
    try:
        got = _engine_tokens(llm, prompts)
        for i, (tokens, prompt) in enumerate(zip(got, prompts, strict=True)):
            assert tokens == hf_greedy(path, prompt, MAX_TOKENS), f"prompt {i}"
        assert llm.llm_engine.get_stats().num_preemptions_total > 0, "the pool should preempt"
    finally:
        llm.shutdown()


def test_ngram_speculative_decoding_is_lossless() -> None:
    """Drafts accepted and rejected: the KV-sharing layers read the cache rows the verify step
    wrote (and a rejected draft's rows are overwritten later), so tokens stay HF's."""
    path = checkpoint(ARCH, **EVERYTHING)
    prompts = [p * 3 for p in mixed_prompts()[1:7]]  # repeated text: n-gram drafts hit
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(path, dtype="float32", num_gpu_blocks=256, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (out, prompt) in enumerate(zip(outputs, prompts, strict=True)):
        assert list(out.outputs[0].token_ids) == hf_greedy(path, prompt, 16), f"prompt {i}"
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_bidirectional_checkpoint_is_refused_by_name() -> None:
    path = checkpoint(ARCH, use_bidirectional_attention="all")
    with pytest.raises(NotImplementedError, match=r"use_bidirectional_attention='all'"):
        _load(path)


def _conditional_generation_checkpoint(out: str) -> str:
    """A hub-shaped Gemma 4 (`Gemma4ForConditionalGeneration`: a one-layer vision tower
    beside the "dense" text model) written by transformers, with the tiny tokenizer."""
    import transformers

    from tests.tiny_checkpoints import _perturb, tiny_config

    # As the larger hub models say: image tokens attend both ways, text is causal.
    text = tiny_config(ARCH, use_bidirectional_attention="vision").to_dict()
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }
    config = transformers.Gemma4Config(
        text_config=text,
        vision_config=vision,
        architectures=["Gemma4ForConditionalGeneration"],
    )
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(config)
    _perturb(model, 0)
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


def test_conditional_generation_checkpoint_serves_text(tmp_path: Any) -> None:
    """The hub's class loads its language model and tower and generates HF's greedy tokens
    for text prompts (images: tests/models/test_gemma4_vl.py)."""
    path = _conditional_generation_checkpoint(str(tmp_path / "gemma4-mm"))
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(
            _logits(_load(path), ids), _hf_logits(path, ids), atol=1e-4, rtol=0
        )
    prompts = mixed_prompts()[:4]
    llm = LLM(path, dtype="float32", num_gpu_blocks=64)
    got = _engine_tokens(llm, prompts)
    assert got == [hf_greedy(path, p, MAX_TOKENS) for p in prompts]
    image = {"prompt": "hi", "multi_modal_data": {"image": torch.zeros(3, 32, 32)}}
    with pytest.raises(ValueError, match=r"multi_modal_data\['image'\]\[0\] must be a PIL"):
        llm.generate(image, GREEDY, use_tqdm=False)
