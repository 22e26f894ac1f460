"""Gemma 2, Gemma 3 and windowed Qwen2/Qwen3 against Hugging Face on tiny checkpoints.

These are the models whose layers need different attention metadata (sliding and global layers
alternate), so the tests use prompts several times longer than the window (8 tokens) and run
them through the engine's paths that move window boundaries around: chunked prefill, prefix
caching, preemption. The tiny Gemma configs use soft-caps small enough to change the logits;
`test_soft_caps_change_the_logits` proves that, so a path that dropped a cap would fail here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine._fixtures import assert_pool_clean, checkpoint, hf_greedy, mixed_prompts
from tests.models.test_moe_models_vs_hf import _hf_logits, _load, _logits
from tokenwise import LLM, SamplingParams
from tokenwise.attention.layer import Attention
from tokenwise.models.gemma2 import gemma_layer_types
from tokenwise.models.llama import layer_sliding_window

WINDOW = 8
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Qwen: layers at or past max_window_layers slide (HF's rule), so 1 global + 2 sliding layers.
QWEN_WINDOWED = {
    "use_sliding_window": True,
    "sliding_window": WINDOW,
    "max_window_layers": 1,
    "num_hidden_layers": 3,
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": ("Gemma2ForCausalLM", {}),
    "gemma3": ("Gemma3ForCausalLM", {}),
    "qwen2-windowed": ("Qwen2ForCausalLM", QWEN_WINDOWED),
    "qwen3-windowed": ("Qwen3ForCausalLM", QWEN_WINDOWED),
}


def _ids(n: int = 40) -> torch.Tensor:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(3))


def _windows(model: torch.nn.Module) -> list[int | None]:
    return [m.sliding_window for m in model.modules() if isinstance(m, Attention)]


@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf_past_the_window(case: str) -> None:
    arch, overrides = CASES[case]
    path = checkpoint(arch, **overrides)
    model, ids = _load(path), _ids()
    with torch.no_grad():
        torch.testing.assert_close(_logits(model, ids), _hf_logits(path, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("gemma2", [WINDOW, None, WINDOW, None]),
        ("gemma3", [WINDOW, WINDOW, None, WINDOW]),
        ("qwen2-windowed", [None, WINDOW, WINDOW]),
        ("qwen3-windowed", [None, WINDOW, WINDOW]),
    ],
)
def test_each_layer_gets_its_own_window(case: str, expected: list[int | None]) -> None:
    arch, overrides = CASES[case]
    assert _windows(_load(checkpoint(arch, **overrides))) == expected


def test_older_configs_imply_the_layer_types() -> None:
    """Before `layer_types`, Gemma 2 alternated (sliding first) and Gemma 3 made every
    `sliding_window_pattern`-th layer global."""
    from types import SimpleNamespace

    gemma2 = SimpleNamespace(num_hidden_layers=4)
    gemma3 = SimpleNamespace(num_hidden_layers=7, sliding_window_pattern=3)
    assert gemma_layer_types(gemma2) == ["sliding_attention", "full_attention"] * 2
    assert [t[0] for t in gemma_layer_types(gemma3)] == list("ssfssfs")


def test_qwen_configs_without_layer_types_slide_from_max_window_layers() -> None:
    """transformers 4.x Qwen2 configs carry only `use_sliding_window` + `max_window_layers`."""
    from types import SimpleNamespace

    hf = SimpleNamespace(use_sliding_window=True, max_window_layers=2)
    config: Any = SimpleNamespace(model=SimpleNamespace(sliding_window=WINDOW, hf_config=hf))
    assert [layer_sliding_window(config, i) for i in range(4)] == [None, None, WINDOW, WINDOW]
    hf.use_sliding_window = False  # Mistral-like configs without the switch slide everywhere
    del hf.max_window_layers
    assert [layer_sliding_window(config, i) for i in range(2)] == [WINDOW, WINDOW]


def test_soft_caps_change_the_logits() -> None:
    """The tiny Gemma 2's caps are active: HF without them gives clearly different logits, so
    matching HF with them (above) means every cap is applied."""
    from transformers import AutoModelForCausalLM

    path, ids = checkpoint("Gemma2ForCausalLM"), _ids()
    with_caps = _hf_logits(path, ids)
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **{cap: None})
        with torch.no_grad():
            without = hf.eval()(ids[None]).logits[0]
        assert (without - with_caps).abs().max() > 0.1, cap


def _engine_tokens(path: str, prompts: list[list[int]], **kwargs: Any) -> tuple[Any, list[Any]]:
    llm = LLM(path, dtype="float32", seed=0, **{"num_gpu_blocks": 256, **kwargs})
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_pool_clean(llm.llm_engine)
    return llm, [list(o.outputs[0].token_ids) for o in outputs]


SCHEDULES = {
    "default": {},
    "chunked-8": {"max_num_batched_tokens": 8},
    "preempt-chunked-16": {
        "max_model_len": 192,
        "max_num_batched_tokens": 16,
    },
}
# A pool two blocks above one 192-token sequence, so that the 18 prompts preempt each other.
# Sliding and global layers share tensors (tokenwise.kv_cache.layout): a block costs one page
# of as many layers as the smallest kind has, and a sequence holds 192 / 16 = 12 blocks in
# each global group but only the blocks a 16-token step and its 8-token window span (3) in
# each sliding group. Gemma 2: 1 global + 1 sliding group of 2 layers (12 + 3); Gemma 3: 1
# global + 3 sliding groups of 1 layer (12 + 9); Qwen: 1 global + 2 sliding (12 + 6).
SMALL_POOL = {"gemma2": 15 + 2, "gemma3": 21 + 2, "qwen2-windowed": 18 + 2}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", ["gemma2", "gemma3", "qwen2-windowed"])
def test_greedy_tokens_match_hf_under_every_schedule(case: str, schedule: str) -> None:
    """All 18 mixed prompts (1..95 tokens: most far past the window, four sharing a 40-token
    prefix, so prefix-cache hits land on window boundaries) equal HF `generate`."""
    arch, overrides = CASES[case]
    path = checkpoint(arch, **overrides)
    prompts = mixed_prompts()
    refs = [hf_greedy(path, p, MAX_TOKENS) for p in prompts]
    kwargs = dict(SCHEDULES[schedule])
    if schedule.startswith("preempt"):
        kwargs["num_gpu_blocks"] = SMALL_POOL[case]
    llm, got = _engine_tokens(path, prompts, **kwargs)
    for i, (tokens, want) in enumerate(zip(got, refs, strict=True)):
        assert tokens == want, f"{case}/{schedule}: prompt {i} of {len(prompts[i])} tokens"
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits > 0, "the shared prefix should hit the cache"
    if schedule.startswith("preempt"):
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the small pool should preempt"
