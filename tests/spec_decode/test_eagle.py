"""EAGLE-1 and EAGLE-3 speculation through the whole engine.

Greedy output with a random head must be Hugging Face's greedy output under every scheduling
that moves requests' blocks or splits their steps; the features the head is given must be the
target's hidden states as transformers computes them (at the right positions, after rejected
drafts); a head built to copy `counting_target` must get its drafts accepted (all of them for
EAGLE-1; for EAGLE-3 the first of each step, since its later drafts read the head's own output
row, which the hand-built head cannot advance); no features are kept while speculation is off;
bad heads are errors naming the field. Heads are written in the published checkpoint layouts
(`eagle_heads.py`); `test_eagle_reference.py` checks every draft against a reference.
"""

from __future__ import annotations

import os
import tempfile
from functools import cache
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine._fixtures import (
    LLAMA,
    NUM_BLOCKS,
    _tmp_dir,
    assert_pool_clean,
    checkpoint,
    hf_greedy,
    hf_model,
    mixed_prompts,
)
from tests.spec_decode.eagle_heads import counting_target, eagle1_head, eagle3_head
from tokenwise import LLM, SamplingParams
from tokenwise.config import SpeculativeConfig

MAX_TOKENS = 12
K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PARITY_SETTINGS = [
    {},
    {"max_num_batched_tokens": 8},
    {"num_gpu_blocks": 12, "max_model_len": 192},
    {"num_gpu_blocks": 12, "max_model_len": 192, "max_num_batched_tokens": 16},
    {"max_num_seqs": 1},
]
PARITY_IDS = ["default", "chunked-8", "preempt", "preempt-chunked-16", "max-num-seqs-1"]
# EAGLE-3's default layers (2, L // 2, L - 3) need a target of at least 7 layers.
EAGLE3_LAYERS = 8


def _dir(name: str) -> str:
    return os.path.join(tempfile.mkdtemp(dir=_tmp_dir()), name)


@cache
def target(method: str) -> str:
    return checkpoint(LLAMA, num_hidden_layers=EAGLE3_LAYERS if method == "eagle3" else 2)


@cache
def random_head(method: str) -> str:
    make = eagle1_head if method == "eagle" else eagle3_head
    return make(_dir(method), target(method), seed=3)


@cache
def counting() -> str:
    return counting_target(tempfile.mkdtemp(dir=_tmp_dir()))


@cache
def hf_refs(path: str) -> list[list[int]]:
    return [hf_greedy(path, p, MAX_TOKENS) for p in mixed_prompts()]


def make_llm(path: str, method: str, head: str, k: int = K, **overrides: Any) -> LLM:
    kwargs: dict[str, Any] = {"dtype": "float32", "num_gpu_blocks": NUM_BLOCKS, "seed": 0}
    kwargs.update(overrides)
    spec = {"method": method, "model": head, "num_speculative_tokens": k}
    spec["disable_by_batch_size"] = 64
    return LLM(path, speculative_config=spec, **kwargs)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("config", PARITY_SETTINGS, ids=PARITY_IDS)
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_with_a_random_head_equals_hf(method: str, config: dict[str, Any]) -> None:
    path, prompts = target(method), mixed_prompts()
    llm = make_llm(path, method, random_head(method), **config)
    assert llm.llm_engine.runner.hidden_capture is not None
    assert generate(llm, prompts) == hf_refs(path)
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_drafts > 0
    assert stats.generation_tokens_total == len(prompts) * MAX_TOKENS
    assert_pool_clean(llm.llm_engine)
    if not config:  # again: prompts' blocks are prefix-cache hits, with no features for them
        assert generate(llm, prompts) == hf_refs(path)
        assert llm.llm_engine.get_stats().prefix_cache_hits > 0
        assert_pool_clean(llm.llm_engine)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_features_are_not_kept_while_speculation_is_off(method: str) -> None:
    """Four requests at a time with `disable_by_batch_size=3`: no drafts and no features kept
    while three or more run; at the tail the last requests draft again from features they
    got only from then on (a gap the head starts after), and the output stays HF's."""
    path, prompts = target(method), mixed_prompts()
    llm = make_llm(path, method, random_head(method), max_num_seqs=4)
    llm.llm_engine.drafter.config.disable_by_batch_size = 3
    proposer = llm.llm_engine.drafter.draft_model
    kept: list[int] = []
    observe = proposer.observe
    proposer.observe = lambda th: (observe(th), kept.append(proposer.num_tracked))[0]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS + i % 5, ignore_eos=True)
            for i in range(len(prompts))
        ],
        use_tqdm=False,
    )
    refs = [hf_greedy(path, p, MAX_TOKENS + i % 5) for i, p in enumerate(prompts)]
    assert [list(o.outputs[0].token_ids) for o in outputs] == refs
    # Four run from the first step on: after it (before any proposal) nothing is kept...
    assert kept[1] == 0
    assert kept[-1] > 0  # ...until the tail, when fewer than three run
    assert llm.llm_engine.get_stats().spec_decode_num_drafts > 0
    assert_pool_clean(llm.llm_engine)


def _hf_features(path: str, method: str, tokens: list[int]) -> torch.Tensor:
    """What the head should be given for `tokens`, from transformers: the last hidden state
    (after the final norm) for EAGLE-1; the inputs of layers 2, L // 2, L - 3 for EAGLE-3."""
    model = hf_model(path)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        if method == "eagle":
            return model.model(ids).last_hidden_state[0]
        layers = (2, EAGLE3_LAYERS // 2, EAGLE3_LAYERS - 3)
        seen: dict[int, torch.Tensor] = {}
        hooks = [
            model.model.layers[i].register_forward_pre_hook(
                lambda m, a, kw, i=i: seen.__setitem__(i, (a[0] if a else kw["hidden_states"])[0]),
                with_kwargs=True,
            )
            for i in layers
        ]
        try:
            model(ids)
        finally:
            for hook in hooks:
                hook.remove()
        return torch.cat([seen[i] for i in layers], dim=-1)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got, want, atol=1e-4 * max(1.0, float(want.abs().max())))


@pytest.mark.parametrize(("method", "copy"), [("eagle", False), ("eagle3", False), ("eagle", True)])
def test_the_head_is_given_the_targets_hidden_states(method: str, copy: bool) -> None:
    """Every catch-up row the head reads equals transformers' feature at that position of the
    finished sequence: no row of a rejected draft, no shifted position, across prompt chunks
    (8-token steps) and verified steps. The copying head has every draft accepted, so the
    rows of accepted drafts are checked too."""
    path = counting() if copy else target(method)
    head = eagle1_head(_dir("copy"), path, copy=True) if copy else random_head(method)
    llm = make_llm(path, method, head, max_num_batched_tokens=8)
    runner = llm.llm_engine.drafter.draft_model.runner
    combine, run_head = runner.combine, runner.run_head
    pending: list[torch.Tensor] = []
    seen: list[tuple[int, list[int], torch.Tensor]] = []

    def spy_combine(rows: torch.Tensor) -> torch.Tensor:
        pending.append(rows.clone())
        return combine(rows)

    def spy_run_head(seqs: list[Any], feats: list[torch.Tensor]) -> Any:
        if pending:  # a catch-up pass: one combined block of target rows per sequence
            assert len(pending) == len(seqs)
            seen.extend((s.start, s.tokens.tolist(), r) for s, r in zip(seqs, pending, strict=True))
            pending.clear()
        return run_head(seqs, feats)

    runner.combine, runner.run_head = spy_combine, spy_run_head
    prompts = mixed_prompts()
    outputs = generate(llm, prompts)
    assert outputs == hf_refs(path)
    full = [p + o for p, o in zip(prompts, outputs, strict=True)]
    features = [_hf_features(path, method, seq) for seq in full]
    decode_rows = 0
    for start, tokens, rows in seen:
        span = slice(start, start + len(tokens))
        owners = [i for i, seq in enumerate(full) if seq[start + 1 : span.stop + 1] == tokens]
        # fp32 within 1e-4 of the features' scale: EAGLE-3's reach ~20, where the CPU kernels'
        # summation order alone moves an entry by ~1e-4 (seen: 1.5e-4 on an AMD EPYC).
        close = (_close(rows, features[i][span]) for i in owners)
        assert any(close), start
        decode_rows += sum(start >= len(prompts[i]) for i in owners[:1])
    assert decode_rows > 0  # rows of verified steps, not only of prompts
    if copy:
        stats = llm.llm_engine.get_stats()
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_copying_head_is_accepted(method: str) -> None:
    """On `counting_target` the EAGLE-1 copy head proposes exactly the target's greedy tokens
    (every draft accepted: token, position and K/V bookkeeping all line up); the EAGLE-3 one
    gets its first draft right whenever the token is in its draft vocabulary (through d2t)."""
    path, prompts = counting(), mixed_prompts()
    make = eagle1_head if method == "eagle" else eagle3_head
    llm = make_llm(path, method, make(_dir("copy"), path, copy=True))
    assert generate(llm, prompts) == hf_refs(path)
    stats = llm.llm_engine.get_stats()
    drafted, accepted = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    if method == "eagle":
        assert accepted == drafted > 0
        assert per_pos[0] == stats.spec_decode_num_drafts
    else:
        assert per_pos[0] >= 0.8 * stats.spec_decode_num_drafts > 0
    assert_pool_clean(llm.llm_engine)


def _without(head: str, name: str) -> str:
    weights = load_file(os.path.join(head, "model.safetensors"))
    del weights[name]
    save_file(weights, os.path.join(head, "model.safetensors"), metadata={"format": "pt"})
    return head


@pytest.mark.parametrize(
    ("method", "make_head", "message"),
    [
        (
            "eagle",
            lambda: eagle1_head(_dir("narrow"), target("eagle"), hidden_size=32),
            "hidden_size is 32, the target's is 64",
        ),
        (
            "eagle",
            lambda: _without(eagle1_head(_dir("nofc"), target("eagle")), "fc.weight"),
            "speculative_config.model .* missing tensors: fc.weight",
        ),
        (
            "eagle3",
            lambda: eagle3_head(_dir("nod2t"), target("eagle3"), with_d2t=False),
            "draft_vocab_size is .* no d2t tensor",
        ),
        (
            "eagle3",
            lambda: eagle3_head(_dir("wide"), target("eagle3"), target_hidden_size=48),
            "target_hidden_size is 48",
        ),
        (
            "eagle3",
            lambda: eagle3_head(_dir("shallow"), target("eagle")),
            "eagle_aux_hidden_state_layer_ids",
        ),
    ],
    ids=["eagle-hidden-size", "eagle-missing-fc", "eagle3-no-d2t", "eagle3-width", "eagle3-depth"],
)
def test_bad_heads_name_the_field(method: str, make_head: Any, message: str) -> None:
    head = make_head()
    path = target("eagle") if "shallow" in head else target(method)
    with pytest.raises(ValueError, match=message):
        make_llm(path, method, head)


def test_eagle_configs_need_a_head_directory() -> None:
    with pytest.raises(ValueError, match="speculative_config.model is required for method 'eagle'"):
        SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="speculative_config.model must be a checkpoint dir"):
        SpeculativeConfig.from_dict(
            {"method": "eagle3", "model": "./no-such-head", "num_speculative_tokens": 2}
        )
    with pytest.raises(ValueError, match="prompt_lookup_max applies to method 'ngram'"):
        SpeculativeConfig.from_dict(
            {"method": "eagle", "model": ".", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
        )


def test_tensor_parallel_with_an_eagle_head_is_refused_before_any_worker_starts() -> None:
    spec = {"method": "eagle", "model": random_head("eagle"), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="method 'eagle'.* tensor_parallel_size=2"):
        LLM(target("eagle"), tensor_parallel_size=2, speculative_config=spec)


def test_guided_and_lora_requests_with_an_eagle_head() -> None:
    """A LoRA request and a guided one in the same speculative batches as plain ones: the head
    proposes for all of them (from the adapted target's hidden states where an adapter is
    active), verification keeps every output what it is without speculation."""
    from tests.lora.test_lora_vs_peft import request
    from tokenwise import GuidedDecodingParams

    path = checkpoint(LLAMA)
    head = eagle1_head(_dir("eagle-lora"), path, seed=5)
    prompts = mixed_prompts()[:4]
    guided = SamplingParams(
        temperature=0.0, max_tokens=8, guided_decoding=GuidedDecodingParams(regex="(ab|cd)+")
    )
    params = [GREEDY, guided, GREEDY, GREEDY]
    loras = [None, None, request(LLAMA, "all-r8"), None]
    lora = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}

    def run(llm: LLM) -> list[Any]:
        inputs = [{"prompt_token_ids": p} for p in prompts]
        return llm.generate(inputs, params, use_tqdm=False, lora_request=loras)

    plain = LLM(path, dtype="float32", num_gpu_blocks=NUM_BLOCKS, seed=0, **lora)
    ref = run(plain)
    llm = make_llm(path, "eagle", head, **lora)
    outs = run(llm)
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        list(o.outputs[0].token_ids) for o in ref
    ]
    assert outs[1].outputs[0].text == ref[1].outputs[0].text
    assert llm.llm_engine.get_stats().spec_decode_num_draft_tokens > 0
    assert_pool_clean(llm.llm_engine)
