"""Speculative verification under FULL CUDA graphs, on CPU, with capture and replay faked.

A step where every request verifies exactly k drafts is a uniform batch of query length 1 + k:
it must dispatch FULL under `BatchDescriptor(padded, padded // (1 + k), uniform=True)` and
replay a graph captured over decode rows, padding rows included. `EagerReplayCapturer` replays
on the same persistent buffers, so stale or wrongly laid-out rows give wrong tokens here as a
replayed graph would. Drafts come from an oracle that knows HF's continuation and plants a
wrong draft every other step, so accepted and rejected drafts (and their rollback) both occur;
near the end drafts are cut to the tokens left, so some steps mix requests with different draft
counts: laid out as decode rows, those replay the FULL decode graph of their token count.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine._fixtures import LLAMA, assert_pool_clean, checkpoint, hf_greedy, mixed_prompts
from tests.runner.test_graph_runner import Recorder, assert_same_outputs
from tests.spec_decode.test_draft_model import noisy_draft
from tests.spec_decode.test_spec_engine import NGRAM, K, with_oracle
from tokenwise import LLM, SamplingParams
from tokenwise.attention.backends import selector
from tokenwise.config import CUDAGraphMode
from tokenwise.entrypoints.llm import build_engine_config
from tokenwise.forward_context import BatchDescriptor
from tokenwise.runner import graph_setup

M = CUDAGraphMode
MAX_TOKENS = 12
SIZES = [1, 2, 4, 8, 16, 32]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def prompts_and_refs() -> tuple[str, list[list[int]], list[list[int]]]:
    path = checkpoint(LLAMA)
    prompts = [p for p in mixed_prompts() if 3 <= len(p) <= 40][:3]
    return path, prompts, [hf_greedy(path, p, MAX_TOKENS) for p in prompts]


def generate(
    path: str,
    prompts: list[list[int]],
    refs: list[list[int]],
    mode: Any,
    spec: Any = NGRAM,
    **overrides: Any,
) -> Any:
    """The engine with speculation `spec` (n-gram: oracle drafts) in graph `mode` (None:
    eager); its outputs and, per step, the draft counts, the graph it ran and the uniform
    query length."""
    config = build_engine_config(
        path,
        dtype="float32",
        num_gpu_blocks=64,
        enforce_eager=True,
        speculative_config=spec,
        **overrides,
    )
    if mode is not None:
        config.compilation.cudagraph_mode = mode
        config.compilation.cudagraph_capture_sizes = SIZES
        if mode.requires_piecewise_compilation():
            config.compilation.use_compile = True
            config.compilation.piece_backend = "eager"
    llm = LLM.from_engine_config(config)
    if spec is NGRAM:
        with_oracle(llm, prompts, refs)
    runner = llm.llm_engine.runner
    steps: list[tuple[list[int], int, Any, int]] = []
    execute = runner.execute_model

    def recording(sched: Any) -> Any:
        out = execute(sched)
        drafts = [len(s.spec_token_ids) for s in sched.scheduled]
        tokens = sum(s.num_new_tokens for s in sched.scheduled)
        steps.append((drafts, tokens, runner.last_graph, runner.last_query_len))
        return out

    runner.execute_model = recording
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return llm, outs, steps


def token_ids(outs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("mode", [M.FULL, M.FULL_AND_PIECEWISE], ids=["full", "full-piecewise"])
def test_uniform_verify_steps_replay_full_graphs_and_keep_greedy_output(
    monkeypatch: pytest.MonkeyPatch,
    prompts_and_refs: tuple[str, list[list[int]], list[list[int]]],
    mode: CUDAGraphMode,
) -> None:
    path, prompts, refs = prompts_and_refs
    monkeypatch.setenv(selector.ENV_VAR, "triton")  # whole steps are captured with it
    torch._dynamo.reset()
    eager_llm, eager, _ = generate(path, prompts, refs, None)
    recorder = Recorder()
    monkeypatch.setattr(graph_setup, "new_capturer_factory", recorder.factory)
    llm, outs, steps = generate(path, prompts, refs, mode)

    assert token_ids(outs) == refs == token_ids(eager)
    assert_same_outputs(outs, eager)  # tokens and their logprobs
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_pool_clean(llm.llm_engine)

    # Padding rows wrote only to the trash block (the last): every real block holds what eager
    # wrote, rejected drafts' K/V included (same drafts, same slots).
    name = next(iter(llm.llm_engine.runner.kv_caches))
    cache = llm.llm_engine.runner.kv_caches[name]
    eager_cache = eager_llm.llm_engine.runner.kv_caches[name]
    torch.testing.assert_close(cache[:, :-1], eager_cache[:, :-1], atol=1e-5, rtol=0)
    assert cache[:, -1].abs().sum() > 0 and eager_cache[:, -1].abs().sum() == 0

    # FULL_AND_PIECEWISE captures verify keys at start-up next to the exact decode keys; plain
    # FULL mode keys every graph by token count only (decode steps too), so verify steps
    # replay those.
    keys = llm.llm_engine.runner.graph_runner.dispatcher.keys[M.FULL]
    q = 1 + K
    exact = mode == M.FULL_AND_PIECEWISE
    if exact:
        assert {BatchDescriptor(s, s // q, True) for s in SIZES if s >= q} <= keys
        assert {BatchDescriptor(s, s, True) for s in SIZES} <= keys

    uniform_verify = mixed = 0
    for drafts, tokens, (graph, desc), query_len in steps:
        if drafts and all(d == K for d in drafts):  # every request verifies k drafts
            padded = min(s for s in SIZES if s >= tokens)
            want = BatchDescriptor(padded, padded // q, True) if exact else BatchDescriptor(padded)
            assert (graph, desc, query_len) == (M.FULL, want, q)
            uniform_verify += padded != tokens  # padding requests (3 requests -> 16 tokens)
        elif any(drafts) and len(set(drafts)) > 1:  # verify rows of different draft counts
            mixed += 1  # as decode rows: the decode graph of the padded token count
            padded = min(s for s in SIZES if s >= tokens)
            want = BatchDescriptor(padded, padded, True) if exact else BatchDescriptor(padded)
            assert (graph, desc, query_len) == (M.FULL, want, 1 + max(drafts))
    assert uniform_verify > 0 and mixed > 0
    # Each verify key replays the decode graph of its size: no graph of its own was captured.
    entries = llm.llm_engine.runner.graph_runner.full_model.entries
    assert not exact or all(d.num_reqs == d.num_tokens for d in entries if d.uniform)
    assert sum(c.num_replays for c in recorder.capturers) > 0

    # The step records show the verify steps' descriptor and query length.
    records, _, _ = llm.llm_engine.step_records.since(0)
    shown = [r.descriptor for r in records if r.graph_mode == "FULL"]
    assert any(d["query_len"] == q and d["uniform"] == exact for d in shown)
    assert any(d["query_len"] == 1 for d in shown)  # plain decode steps (no drafts yet)


def test_draft_model_verification_replays_full_graphs(
    monkeypatch: pytest.MonkeyPatch,
    prompts_and_refs: tuple[str, list[list[int]], list[list[int]]],
) -> None:
    """A draft model (the target with noise on one layer: some drafts accepted, some not)
    runs eagerly beside the target, whose uniform verify steps replay FULL graphs. With
    `max_num_seqs=4` decode graphs stop at 8 rows (on CPU, `graph_rows`: a verifying step of 2
    requests), so the verify key of 16 tokens (4 requests) has no decode twin and captures a
    graph of its own."""
    path, prompts, refs = prompts_and_refs
    spec = {"model": noisy_draft(), "num_speculative_tokens": K, "disable_by_batch_size": 64}
    monkeypatch.setenv(selector.ENV_VAR, "triton")
    monkeypatch.setattr(graph_setup, "new_capturer_factory", Recorder().factory)
    llm, outs, steps = generate(path, prompts, refs, M.FULL_DECODE_ONLY, spec, max_num_seqs=4)
    assert token_ids(outs) == refs
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_pool_clean(llm.llm_engine)
    q = 1 + K
    full_verify = [
        desc
        for drafts, _, (graph, desc), query_len in steps
        if drafts and all(d == K for d in drafts) and graph == M.FULL and query_len == q
    ]
    assert full_verify and all(d.uniform and d.num_reqs == d.num_tokens // q for d in full_verify)
    entries = llm.llm_engine.runner.graph_runner.full_model.entries
    assert BatchDescriptor(16, 4, True) in entries and BatchDescriptor(8, 8, True) in entries
    assert not {BatchDescriptor(4, 1, True), BatchDescriptor(8, 2, True)} & set(entries)
    assert BatchDescriptor(16, 4, True) in full_verify  # 3 requests verifying: 12 -> 16 tokens
