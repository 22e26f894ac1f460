"""Priority scheduling (`scheduling_policy="priority"`, vLLM's names): who is admitted, who is
preempted, and that none of it changes what a request generates.

The scheduler tests drive the real `Scheduler` and `BlockManager` with the model replaced by
"append token 7 whenever a sequence's last known token was computed" (scheduling never looks
at token values). The engine tests run a tiny fp32 Llama, in process and in an engine-core
process, and compare every request's tokens with the FCFS engine's; the server tests post
`priority` to an in-process app.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine._fixtures import LLAMA, assert_pool_clean, checkpoint, mixed_prompts
from tests.engine.test_scheduler_liveness import run_workload, workloads
from tokenwise import SamplingParams
from tokenwise.config import SchedulerConfig
from tokenwise.engine import core_messages as msg
from tokenwise.engine.block_manager import BlockManager
from tokenwise.engine.client import EngineClient, create_engine
from tokenwise.engine.llm_engine import LLMEngine
from tokenwise.engine.request import Request, RequestStatus
from tokenwise.engine.scheduler import Scheduler
from tokenwise.entrypoints.engine_args import add_engine_args, engine_kwargs
from tokenwise.entrypoints.llm import LLM, build_engine_config
from tokenwise.entrypoints.openai.api_server import build_app
from tokenwise.entrypoints.openai.async_engine import AsyncEngine
from tokenwise.entrypoints.openai.metrics import ServerMetrics
from tokenwise.entrypoints.openai.server_config import ServerConfig

# ---- the scheduler alone ----------------------------------------------------------------------


def _scheduler(policy: str, num_blocks: int = 64, block_size: int = 4, **limits: Any) -> Scheduler:
    config = SchedulerConfig(policy=policy, **limits)
    return Scheduler(config, BlockManager(num_blocks, block_size), max_model_len=256)


def _request(rid: str, priority: int = 0, prompt_len: int = 4, max_tokens: int = 3) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    req = Request(rid, list(range(10, 10 + prompt_len)), params)
    req.priority = priority
    return req


def _step(scheduler: Scheduler) -> Any:
    """One scheduled step with the fake model; the step's output."""
    out = scheduler.schedule()
    scheduler.block_manager.check_invariants()
    finished = []
    for item in out.scheduled:
        req = item.request
        samples = item.completes_sequence
        req.num_computed_tokens += item.num_new_tokens
        if samples:
            req.append_output_token(7)
            if req.num_output_tokens >= req.sampling_params.max_tokens:
                finished.append(req)
    scheduler.finish_requests(finished, RequestStatus.FINISHED_LENGTH)
    return out


def _admissions(
    scheduler: Scheduler, reqs: list[Request], added: int = 0
) -> tuple[list[str], list[str]]:
    """Add `reqs` (but the first `added`, already in) and run to the end: the ids in the order
    they were (re)admitted, and those preempted, in the order they were."""
    for req in reqs[added:]:
        scheduler.add_request(req)
    admitted: list[str] = []
    preempted: list[str] = []
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        before = {id(r) for r in scheduler.running}
        out = _step(scheduler)
        admitted += [i.request.request_id for i in out.scheduled if id(i.request) not in before]
        preempted += [r.request_id for r in reqs if r.status is RequestStatus.PREEMPTED]
    assert not scheduler.has_unfinished_requests()
    bm = scheduler.block_manager
    assert bm.get_num_free_blocks() == bm.num_blocks and bm.pool.num_used == 0
    return admitted, preempted


def test_one_slot_serves_requests_by_priority_then_arrival() -> None:
    priorities = [2, 0, 1, 0, 2]
    reqs = [_request(f"r{i}", p) for i, p in enumerate(priorities)]
    order, _ = _admissions(_scheduler("priority", max_num_seqs=1), reqs)
    assert order == ["r1", "r3", "r2", "r0", "r4"]
    # FCFS ignores priorities (the engine refuses non-zero ones; the scheduler just queues).
    reqs = [_request(f"r{i}", p) for i, p in enumerate(priorities)]
    order, _ = _admissions(_scheduler("fcfs", max_num_seqs=1), reqs)
    assert order == ["r0", "r1", "r2", "r3", "r4"]
    # Equal priorities: arrival order, as FCFS.
    reqs = [_request(f"r{i}") for i in range(4)]
    order, _ = _admissions(_scheduler("priority", max_num_seqs=2), reqs)
    assert order == ["r0", "r1", "r2", "r3"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_more_urgent_request_takes_a_less_urgent_ones_slot(policy: str) -> None:
    scheduler = _scheduler(policy, max_num_seqs=1)
    low = _request("low", priority=5, max_tokens=10)
    scheduler.add_request(low)
    for _ in range(3):
        _step(scheduler)
    assert low.status is RequestStatus.RUNNING and low.num_output_tokens == 3
    tie = _request("tie", priority=5)  # the same priority never preempts
    scheduler.add_request(tie)
    out = _step(scheduler)
    assert out.num_preempted == 0 and [i.request for i in out.scheduled] == [low]
    urgent = _request("urgent", priority=1 if policy == "priority" else 0)
    scheduler.add_request(urgent)
    out = _step(scheduler)
    if policy == "fcfs":
        assert out.num_preempted == 0 and [i.request for i in out.scheduled] == [low]
        return
    assert out.num_preempted == 1 and [i.request for i in out.scheduled] == [urgent]
    assert low.status is RequestStatus.PREEMPTED and low.num_output_tokens == 4  # kept
    assert scheduler.block_manager.num_blocks_of("low") == 0
    # The runner drops its row and keeps its state (its tokens, its generator) for the resume.
    assert out.preempted_req_ids == ["low"] and out.finished_req_ids == []
    # Then: urgent to its end, the preempted one (earlier arrival) before the tie.
    order = []
    while scheduler.has_unfinished_requests():
        before = {id(r) for r in scheduler.running}
        out = _step(scheduler)
        order += [i.request.request_id for i in out.scheduled if id(i.request) not in before]
    assert order == ["low", "tie"] and low.num_output_tokens == 10


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "r2"), ("priority", "r0")])
def test_a_short_pool_preempts_the_least_urgent_request(policy: str, victim: str) -> None:
    """Three 4-token prompts in 6 blocks of 4: the third block each needs does not exist.
    r0 (priority 3) is admitted alone, then r1 (1) and r2 (2) arrive. FCFS preempts the last
    admitted (r2); priority the least urgent (r0), though it was admitted first."""
    reqs = [_request(f"r{i}", p, max_tokens=12) for i, p in enumerate([3, 1, 2])]
    scheduler = _scheduler(policy, num_blocks=6)
    scheduler.add_request(reqs[0])
    _step(scheduler)
    _, preempted = _admissions(scheduler, reqs, added=1)
    assert preempted[0] == victim
    assert scheduler.num_preemptions >= 1
    assert all(r.num_output_tokens == 12 for r in reqs)


def test_a_victim_scheduled_earlier_in_the_step_is_taken_back_out() -> None:
    """`low` runs before `high` in the step; `high` needs the last free block's successor, so
    `low`, already scheduled, is preempted: its entry leaves the step and its token returns to
    the budget."""
    scheduler = _scheduler("priority", num_blocks=3, max_num_batched_tokens=64)
    low, high = _request("low", priority=3), _request("high", priority=1)
    scheduler.add_request(low)
    _step(scheduler)  # low alone: its prompt fills one block
    scheduler.add_request(high)
    _step(scheduler)  # low decodes into a second block, high's prompt takes the third
    assert scheduler.running == [low, high]
    out = _step(scheduler)  # high's decode needs a block: low goes
    assert [i.request for i in out.scheduled] == [high]
    assert out.num_preempted == 1 and low.status is RequestStatus.PREEMPTED
    assert out.total_num_tokens == 1
    assert scheduler.block_manager.num_blocks_of("low") == 0


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workloads(), st.data())
def test_priority_never_livelocks_and_frees_every_block(w: Any, data: st.DataObject) -> None:
    """The liveness property of `test_scheduler_liveness` under the priority policy, with
    random priorities (the most urgent request is never a victim unless alone)."""
    w.policy = "priority"
    w.priorities = data.draw(st.lists(st.integers(-2, 2), min_size=len(w.requests)))
    accepted, _, bm = run_workload(w)
    assert all(req.is_finished for req in accepted)
    assert bm.get_num_free_blocks() == w.num_blocks and bm.pool.num_used == 0


def test_the_wire_message_carries_the_priority() -> None:
    frame = msg.encode(msg.add_request("r", {"prompt_token_ids": [1]}, None, None, None, -3))
    decoded = msg.decode_to_core(frame)
    assert isinstance(decoded, msg.AddRequest) and decoded.priority == -3


# ---- the engine: same tokens, every block free ------------------------------------------------

PRIORITIES = [3, 0, 2, 1, 0, 3, 1, 2]
MAX_TOKENS = 20


def _config(policy: str, **kwargs: Any) -> Any:
    kwargs = {"max_model_len": 64, "num_gpu_blocks": 8, "max_num_seqs": 3, **kwargs}
    return build_engine_config(
        checkpoint(LLAMA), dtype="float32", scheduling_policy=policy, **kwargs
    )


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, LLMEngine]]:
    made = {policy: LLMEngine(_config(policy)) for policy in ("fcfs", "priority")}
    yield made
    for engine in made.values():
        engine.shutdown()


def _prompts() -> list[list[int]]:
    short = [p for p in mixed_prompts() if 4 <= len(p) <= 36]
    return short[: len(PRIORITIES)]


def _run(
    engine: EngineClient, priorities: list[int] | None, max_tokens: list[int] | None = None
) -> tuple[dict[str, list[int]], list[str]]:
    """Every prompt at once; (tokens by request id, request ids in the order they finished)."""
    prompts = _prompts()
    max_tokens = max_tokens or [MAX_TOKENS] * len(prompts)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True)
        extra = {"priority": priorities[i]} if priorities else {}
        engine.add_request(f"r{i}", prompt, params, **extra)
    tokens: dict[str, list[int]] = {}
    finished: list[str] = []
    deadline = time.monotonic() + 120
    while len(finished) < len(prompts):
        assert time.monotonic() < deadline, "requests did not finish"
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                finished.append(out.request_id)
    return tokens, finished


def test_priority_changes_the_order_not_the_tokens(engines: dict[str, LLMEngine]) -> None:
    """8 prompts, 3 request slots and a pool of 8 blocks (each sequence needs up to 3): under
    priority the requests finish most urgent first, the pool's shortage preempts requests,
    and every request's greedy tokens equal the FCFS engine's."""
    expected, fcfs_order = _run(engines["fcfs"], None)
    assert fcfs_order != sorted(fcfs_order, key=lambda r: PRIORITIES[int(r[1:])])
    engine = engines["priority"]
    preemptions = engine.get_stats().num_preemptions_total
    tokens, order = _run(engine, PRIORITIES)
    assert tokens == expected
    assert all(len(t) == MAX_TOKENS for t in tokens.values())
    # Equal lengths: a request finishes before a strictly less urgent one does.
    rank = {rid: PRIORITIES[int(rid[1:])] for rid in order}
    assert [rank[r] for r in order] == sorted(rank[r] for r in order)
    assert engine.get_stats().num_preemptions_total > preemptions
    assert_pool_clean(engine)
    assert_pool_clean(engines["fcfs"])


def test_a_non_zero_priority_needs_the_priority_policy(engines: dict[str, LLMEngine]) -> None:
    engine = engines["fcfs"]
    with pytest.raises(ValueError, match=r"^priority=2 needs scheduling_policy='priority'"):
        engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=1), priority=2)
    for bad in (1.5, "1", True, None):
        with pytest.raises(ValueError, match=r"^priority must be an integer"):
            engines["priority"].add_request("x", [1, 2, 3], priority=bad)  # type: ignore[arg-type]
    assert not engine.has_request("x") and not engines["priority"].has_request("x")
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        SchedulerConfig(policy="lifo")


@pytest.mark.timeout(120)
def test_the_engine_core_process_schedules_by_priority(engines: dict[str, LLMEngine]) -> None:
    """Through `EngineCoreClient` (what `tokenwise serve` runs), with one request slot: a
    long, unimportant request starts first; the others, sent right after, preempt it in
    priority order, whatever step each arrives at. Same tokens as in process."""
    priorities = [9, 3, 1, 2]
    max_tokens = [40, 12, 12, 12]
    config = _config("priority", max_num_seqs=1)
    core = create_engine(config, core_process=True)
    try:
        prompts = _prompts()[: len(priorities)]
        tokens, order = _run_subset(core, prompts, priorities, max_tokens)
    finally:
        core.shutdown()
    assert order == ["r2", "r3", "r1", "r0"]
    local_tokens, _ = _run_subset(engines["priority"], prompts, priorities, max_tokens)
    assert tokens == local_tokens
    assert_pool_clean(engines["priority"])


def _run_subset(
    engine: EngineClient, prompts: list[list[int]], priorities: list[int], max_tokens: list[int]
) -> tuple[dict[str, list[int]], list[str]]:
    tokens: dict[str, list[int]] = {}
    finished: list[str] = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params, priority=priorities[i])
    deadline = time.monotonic() + 90
    while len(finished) < len(prompts):
        assert time.monotonic() < deadline, "requests did not finish"
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                finished.append(out.request_id)
    return tokens, finished


def test_llm_generate_takes_one_priority_per_prompt(engines: dict[str, LLMEngine]) -> None:
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected, _ = _run(engines["fcfs"], None)
    llm = LLM.from_engine_config(_config("priority"))
    try:
        outs = llm.generate(prompts, params, use_tqdm=False, priority=PRIORITIES)
        assert [o.outputs[0].token_ids for o in outs] == [expected[f"r{i}"] for i in range(8)]
        with pytest.raises(ValueError, match="got 2 priority values for 8 prompts"):
            llm.generate(prompts, params, use_tqdm=False, priority=[0, 1])
        assert_pool_clean(llm.llm_engine)
    finally:
        llm.shutdown()


def test_the_cli_flag() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["scheduling_policy"] == "fcfs"
    args = parser.parse_args(["--scheduling-policy", "priority"])
    assert engine_kwargs(args)["scheduling_policy"] == "priority"
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "lifo"])


# ---- the server -------------------------------------------------------------------------------


def _app(engine: LLMEngine) -> Any:
    config = ServerConfig(served_model_name="tiny", max_model_len=64)
    metrics = ServerMetrics("tiny")
    async_engine = AsyncEngine(engine, observer=metrics.observe)  # type: ignore[arg-type]
    metrics.attach_engine(lambda: async_engine.stats)
    return build_app(async_engine, config, metrics)


COMPLETION = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0.0}


def _error(response: Any, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


@pytest.mark.timeout(60)
def test_server_refuses_bad_priorities(engines: dict[str, LLMEngine]) -> None:
    with TestClient(_app(engines["fcfs"])) as client:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            message = _error(client.post(path, json={**body, "priority": 1}), "priority")
            assert "scheduling_policy='priority'" in message
            for bad in ("high", 1.5, True, None):
                _error(client.post(path, json={**body, "priority": bad}), "priority")
            assert client.post(path, json={**body, "priority": 0}).status_code == 200
        plain = client.post("/v1/completions", json=COMPLETION).json()
    assert_pool_clean(engines["fcfs"])
    with TestClient(_app(engines["priority"])) as client:
        urgent = client.post("/v1/completions", json={**COMPLETION, "priority": -5})
        assert urgent.status_code == 200, urgent.text
        assert urgent.json()["choices"][0]["text"] == plain["choices"][0]["text"]
        _error(client.post("/v1/completions", json={**COMPLETION, "priority": "1"}), "priority")
    assert_pool_clean(engines["priority"])
