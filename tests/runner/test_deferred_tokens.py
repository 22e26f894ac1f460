"""Async scheduling's non-blocking copy of sampled ids (`runner/deferred_tokens.py`), on CPU.

No GPU here: the copy is a plain one and the CUDA event is a fake whose copy "lands" only when
the engine's thread asks for it, so every step the runner launches reads its predecessor's
token from the device-side patch, never from the host: the same tokens as a synchronous
engine prove the placeholders, the patch and the late fill right.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests.engine._fixtures import LLAMA, assert_pool_clean, checkpoint, random_ids
from tokenwise import LLM, SamplingParams
from tokenwise.engine.step_outputs import NewRequestData
from tokenwise.runner.deferred_tokens import PLACEHOLDER, DeferredTokens, PendingTokens
from tokenwise.runner.request_states import CachedRequestState
from tokenwise.sampling.sampler import Sampler


class LateEvent:
    """A CUDA event stand-in: not done until `land()`, or the `lands_after`-th query, or
    (`engine_lands`) until a thread other than the forward worker asks, as the engine's thread
    does when it applies the step."""

    def __init__(self, engine_lands: bool = False, lands_after: int | None = None) -> None:
        self.done = False
        self.engine_lands = engine_lands
        self.lands_after = lands_after
        self.recorded = self.queries = 0

    def record(self) -> None:
        self.recorded += 1

    def land(self) -> None:
        self.done = True

    def query(self) -> bool:
        self.queries += 1
        if self.engine_lands and threading.current_thread().name != "tokenwise-forward_0":
            self.done = True
        if self.lands_after is not None and self.queries >= self.lands_after:
            self.done = True
        return self.done


def state(rid: str, prompt: list[int], **params: Any) -> CachedRequestState:
    sp = SamplingParams(temperature=0.0, max_tokens=8, **params)
    return CachedRequestState.create(NewRequestData(rid, prompt, sp))


def rows_for(states: list[CachedRequestState]) -> SimpleNamespace:
    """An `InputBatch` as `DeferredTokens` reads it: one row per state, tokens cached."""
    token_ids = np.zeros((len(states), 32), dtype=np.int64)
    for row, st in enumerate(states):
        token_ids[row, : st.num_tokens] = st.all_token_ids
    return SimpleNamespace(
        req_index={st.req_id: row for row, st in enumerate(states)},
        row_states=list(states),
        token_ids=token_ids,
    )


def test_pending_tokens_wait_for_the_event_within_a_bound() -> None:
    event = LateEvent()
    pending = PendingTokens(torch.tensor([[5], [7]]), event)
    assert event.recorded == 1 and not pending.ready()
    with pytest.raises(TimeoutError, match="did not reach the host within 0.01 s"):
        pending.wait(timeout_s=0.01)
    event.land()
    assert pending.ready() and pending.token_lists() == [[5], [7]]


def test_placeholders_are_fed_on_the_device_then_filled_once_landed() -> None:
    a, b = state("a", [1, 2, 3]), state("b", [4, 5])
    rows = rows_for([a, b])
    events: list[LateEvent] = []
    deferred = DeferredTokens(lambda: events.append(LateEvent()) or events[-1], rows)
    deferred.launch(torch.tensor([11, 22]), [a, b])
    assert a.all_token_ids == [1, 2, 3, PLACEHOLDER] and b.output_token_ids == [PLACEHOLDER]
    rows.token_ids[0, 3] = rows.token_ids[1, 2] = PLACEHOLDER  # as `prepare` caches them
    # Next step: `a` decodes its placeholder; `b` recomputes prompt and placeholder (3 tokens).
    step = SimpleNamespace(
        states=[b, a],
        context_lens_np=np.array([0, 3]),
        query_lens_np=np.array([3, 1]),
        input_ids=torch.tensor([4, 5, PLACEHOLDER, PLACEHOLDER]),
    )
    assert deferred.patch_inputs(step) == 2
    assert step.input_ids.tolist() == [4, 5, 22, 11]
    deferred.fill(wait=False)  # not landed: the host copies keep their placeholders
    assert deferred.num_in_flight == 1 and a.output_token_ids == [PLACEHOLDER]
    events[0].land()
    deferred.fill(wait=False)
    assert deferred.num_in_flight == 0
    assert a.all_token_ids == [1, 2, 3, 11] and b.output_token_ids == [22]
    assert rows.token_ids[0, 3] == 11 and rows.token_ids[1, 2] == 22
    assert deferred.patch_inputs(step) == 0  # nothing in flight, nothing written


def test_a_step_that_reads_past_tokens_waits_for_them_and_is_sampled_as_usual() -> None:
    greedy, penalised = state("g", [1, 2]), state("p", [3], repetition_penalty=1.3)
    events: list[LateEvent] = []
    deferred = DeferredTokens(lambda: events.append(LateEvent(lands_after=5)) or events[-1], None)
    deferred.rows = rows_for([greedy, penalised])
    item = SimpleNamespace(spec_token_ids=[])
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    pending = deferred.sample(Sampler(), logits, [item], [greedy], 3)
    assert pending is not None and pending.device_ids.tolist() == [1]
    assert greedy.output_token_ids == [PLACEHOLDER]
    # A request that reads its past tokens on the host: the step in flight is waited for
    # first (it lands on the 5th query), and this step takes the usual path (None).
    assert deferred.sample(Sampler(), logits.clone(), [item], [penalised], 3) is None
    assert events[0].queries == 5 and deferred.num_in_flight == 0
    assert greedy.output_token_ids == [1]


def test_cpu_and_sync_engines_keep_the_blocking_path() -> None:
    config = SimpleNamespace(
        scheduler=SimpleNamespace(async_scheduling=True),
        parallel=SimpleNamespace(pipeline_parallel_size=1),
        speculative=None,
    )
    assert DeferredTokens.create(config, torch.device("cpu"), 1, None) is None
    config.scheduler.async_scheduling = False
    assert DeferredTokens.create(config, torch.device("cuda"), 1, None) is None


@pytest.fixture(scope="module")
def path() -> str:
    return checkpoint(LLAMA)


def engine_tokens(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


def test_engine_with_late_copies_matches_the_sync_engine(path: str) -> None:
    """An async engine whose runner defers every greedy step's ids (copies landing only when
    the engine's thread applies the step), in a pool small enough to preempt: the same tokens,
    texts and finish reasons as a synchronous engine."""
    kwargs: dict[str, Any] = {
        "dtype": "float32",
        "num_gpu_blocks": 8,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 4,
        "max_model_len": 64,
    }
    g = torch.Generator().manual_seed(7)
    batch = [random_ids(g, 3 + (11 * i) % 40) for i in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6 + 2 * i, ignore_eos=True) for i in range(6)
    ]
    params[1] = SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.2)
    want = engine_tokens(LLM(path, **kwargs), batch, params)
    llm = LLM(path, async_scheduling=True, **kwargs)
    runner = llm.llm_engine.runner
    inputs_events: list[LateEvent] = []

    def inputs_event() -> LateEvent:  # input copies that run after two looks
        inputs_events.append(LateEvent(lands_after=2))
        return inputs_events[-1]

    late = DeferredTokens(lambda: LateEvent(engine_lands=True), runner.input_batch, inputs_event)
    runner.deferred = late
    launched = []
    real_launch = runner.deferred.launch

    def spy(ids: torch.Tensor, states: list) -> PendingTokens:
        launched.append(len(states))
        return real_launch(ids, states)

    runner.deferred.launch = spy  # type: ignore[method-assign]
    assert engine_tokens(llm, batch, params) == want
    assert sum(launched) > 20  # most steps took the deferred path
    # Every step but the last waited for its predecessor's input copies before writing its own.
    assert len(inputs_events) > 20 and all(e.queries == 2 for e in inputs_events[:-1])
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_pool_clean(llm.llm_engine)
