"""Verifying steps of any draft count replay the CPU decode graph of their token count.

Suffix decoding and the per-request draft budget vary the number of drafts per step and per
request, so verifying batches are rarely uniform. Laid out as one decode row per query token
(`runner/verify_rows.graph_query_len`), such a step is a decode batch and replays the real
CPU graph (`compilation/cpu_graph.py`) of its padded size. What must hold: the same tokens and
logprobs as the engine without graphs (which verifies eagerly), every verifying step that fits
a captured size replayed one, and larger ones ran eagerly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine._fixtures import LLAMA, assert_pool_clean, checkpoint, mixed_prompts
from tokenwise import LLM, SamplingParams
from tokenwise.config import CUDAGraphMode
from tokenwise.native import fused as cpu_fused
from tokenwise.native import graph as native_graph

pytestmark = pytest.mark.skipif(
    native_graph.load() is None or cpu_fused.load() is None, reason="no C compiler"
)

SIZES = [1, 2, 4, 8]  # the CPU capture sizes of this model in float32
SPEC = {"method": "suffix", "num_speculative_tokens": 10, "disable_by_batch_size": 1000}
# The second request ends early: the first then verifies alone (steps of 1 + d tokens).
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (32, 6)
]


class Oracle:
    """Suffix decoding's place in the drafter: drafts the known continuation, up to the
    budget's limit, with every third proposal's third draft wrong (accepted and rejected
    drafts both occur; the budget still grows past 7 drafts)."""

    num_tracked = 0

    def __init__(self, refs: dict[tuple[int, ...], list[int]]) -> None:
        self.refs, self.calls = refs, 0

    def propose(self, tokens: Any, max_tokens: int, request_id: str = "") -> list[int]:
        seq = tokens.tolist()
        for prompt, cont in self.refs.items():
            done = len(seq) - len(prompt)
            if done >= 0 and seq[: len(prompt)] == list(prompt):
                drafts = list(cont[done : done + max_tokens])
                self.calls += 1
                if self.calls % 3 == 0 and len(drafts) > 2:
                    drafts[2] = (drafts[2] + 1) % 256
                return drafts
        return []

    def finish(self, *args: Any) -> None:
        pass

    def forget(self, alive: Any) -> None:
        pass


def run(
    path: str, prompts: list[list[int]], eager: bool, refs: list[list[int]] | None
) -> tuple[LLM, list[Any], list[Any]]:
    """Outputs (drafts from an `Oracle` over `refs`; None: no speculation) and, per step:
    (drafts per request, whether every request runs one token plus its drafts, tokens, graph
    mode, descriptor)."""
    llm = LLM(
        path,
        speculative_config=None if refs is None else SPEC,
        dtype="float32",
        num_gpu_blocks=64,
        max_num_seqs=8,  # capture sizes 1, 2, 4, 8
        max_model_len=256,
        **({"enforce_eager": True} if eager else {}),  # CPU graphs are the default on CPU
    )
    if refs is not None:
        drafter = llm.llm_engine.drafter
        assert drafter is not None
        drafter.suffix = Oracle({tuple(p): r for p, r in zip(prompts, refs, strict=True)})
    runner, steps = llm.llm_engine.runner, []
    execute = runner.execute_model

    def recording(sched: Any) -> Any:
        out = execute(sched)
        drafts = [len(s.spec_token_ids) for s in sched.scheduled]
        rows_only = all(s.num_new_tokens == 1 + len(s.spec_token_ids) for s in sched.scheduled)
        tokens = sum(s.num_new_tokens for s in sched.scheduled)
        steps.append((drafts, rows_only, tokens, *runner.last_graph))
        return out

    runner.execute_model = recording
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return llm, outs, steps


def test_verifying_steps_of_any_draft_count_replay_decode_graphs_with_eager_output() -> None:
    path = checkpoint(LLAMA)
    prompts = [p for p in mixed_prompts() if 3 <= len(p) <= 30][:2]
    _, plain, _ = run(path, prompts, eager=True, refs=None)
    refs = [list(o.outputs[0].token_ids) for o in plain]
    _, eager, _ = run(path, prompts, eager=True, refs=refs)
    llm, outs, steps = run(path, prompts, eager=False, refs=refs)

    for got, want, ref in zip(outs, eager, refs, strict=True):
        assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids) == ref
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            for token in a:
                torch.testing.assert_close(a[token].logprob, b[token].logprob, atol=1e-4, rtol=0)
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_pool_clean(llm.llm_engine)

    graphed = eager_steps = 0
    verify = [step for step in steps if any(step[0]) and step[1]]
    for drafts, _, tokens, mode, desc in verify:
        if tokens <= max(SIZES):
            padded = min(s for s in SIZES if s >= tokens)
            assert mode == CUDAGraphMode.FULL, (drafts, tokens)
            assert (desc.num_tokens, desc.num_reqs) == (padded, padded)
            graphed += 1
        else:
            assert mode == CUDAGraphMode.NONE
            eager_steps += 1
    # Non-uniform steps (different draft counts, or fewer than k) among the graphed ones, and
    # steps too large for a graph: both paths were taken.
    assert graphed and eager_steps
    assert any(len(set(d)) > 1 or max(d) < SPEC["num_speculative_tokens"] for d, *_ in verify)
    entries = llm.llm_engine.runner.graph_runner.full_model.entries.values()
    assert sum(e.capturer.num_replays for e in entries) >= graphed
