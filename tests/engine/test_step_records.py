"""Per-step records (`engine.step_records`): the ring's bound and cursor, and what an in-process
engine records for a known workload (token counts, the prefill/decode split, aborts, the KV
figures), so the server's engine view draws what the engine really ran."""

from __future__ import annotations

import msgspec
import pytest

from tests.engine._fixtures import NUM_BLOCKS, checkpoint
from tokenwise.engine import core_messages as msg
from tokenwise.engine.stats import EngineStats
from tokenwise.engine.step_records import (
    ENV_CAPACITY,
    StepRecord,
    StepRecords,
    capacity_from_env,
)
from tokenwise.entrypoints.llm import LLM
from tokenwise.sampling.params import SamplingParams


def record(seq: int, prefill: int = 0, decode: int = 1) -> StepRecord:
    return StepRecord(
        seq, 0, 0.0, 1, prefill, decode, int(bool(prefill)), 1.0, 1.2, "NONE", None,
        1, 0, 2, 0, 6, 0, 0, 0,
    )  # fmt: skip


def test_ring_keeps_the_last_capacity_records_and_counts_what_a_reader_missed() -> None:
    ring = StepRecords(capacity=4)
    for seq in range(10):
        ring.append(record(seq))
    assert len(ring) == 4 and ring.total == 10
    items, cursor, missed = ring.since(0)
    assert [r.seq for r in items] == [6, 7, 8, 9] and cursor == 10 and missed == 6
    items, cursor, missed = ring.since(8)
    assert [r.seq for r in items] == [8, 9] and cursor == 10 and missed == 0
    assert ring.since(10) == ([], 10, 0)
    ring.extend([record(10), record(11)])
    assert [r.seq for r in ring.since(10)[0]] == [10, 11] and len(ring) == 4


def test_capacity_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_CAPACITY, "16")
    assert capacity_from_env() == 16 and StepRecords().capacity == 16
    monkeypatch.setenv(ENV_CAPACITY, "lots")
    with pytest.raises(ValueError, match=f"{ENV_CAPACITY} must be a whole number"):
        capacity_from_env()
    monkeypatch.setenv(ENV_CAPACITY, "0")
    with pytest.raises(ValueError, match=">= 1"):
        capacity_from_env()


def test_records_travel_from_a_core_in_its_outputs_message() -> None:
    sent = msg.CoreOutputs(
        0, [], EngineStats(), steps=[record(3, prefill=7)], kv_blocks=b"\x02\x01"
    )
    got = msg.decode_from_core(msg.encode(sent))
    assert isinstance(got, msg.CoreOutputs)
    assert got.steps == [record(3, prefill=7)] and got.kv_blocks == b"\x02\x01"
    as_json = msgspec.json.decode(msgspec.json.encode(got.steps[0]))
    assert as_json["prefill_tokens"] == 7 and as_json["graph_mode"] == "NONE"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(checkpoint(), dtype="float32", device="cpu", num_gpu_blocks=NUM_BLOCKS)


def test_engine_records_every_token_of_a_known_workload(llm: LLM) -> None:
    engine = llm.llm_engine
    start = engine.step_records.total
    tokenizer = llm.get_tokenizer()
    prompts = ["The quick brown fox jumps over", "Hello world", "def fibonacci(n):"]
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    max_tokens = 6
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    steps, cursor, missed = engine.step_records.since(start)
    assert missed == 0 and cursor == engine.step_records.total
    # Every prompt token runs once (as a prefill); each request then feeds back all its
    # sampled tokens but the last, one per decode step.
    assert sum(r.prefill_tokens for r in steps) == sum(lengths)
    assert sum(r.decode_tokens for r in steps) == len(prompts) * (max_tokens - 1)
    first = steps[0]
    assert (first.num_reqs, first.num_prefills, first.decode_tokens) == (3, 3, 0)
    assert all(r.num_reqs == 3 and r.decode_tokens == 3 for r in steps[1:])
    assert [r.seq for r in steps] == list(range(first.seq, first.seq + len(steps)))
    assert sum(r.finished for r in steps) == 3 and steps[-1].finished == 3
    assert steps[-1].num_running == 0 and steps[-1].kv_used == 0
    assert all(r.kv_used + r.kv_cached + r.kv_free == NUM_BLOCKS for r in steps)
    # On CPU the prefill runs eagerly and every decode step of 3 replays the CPU graph of 4.
    assert first.graph_mode == "NONE" and first.descriptor is None
    assert all(r.graph_mode == "FULL" for r in steps[1:])
    assert all(r.descriptor["num_tokens"] == 4 and r.descriptor["uniform"] for r in steps[1:])
    assert all(0 < r.forward_ms <= r.step_ms for r in steps)


def test_an_abort_is_marked_on_the_next_step(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("long", "Hello", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    start = engine.step_records.total
    engine.abort_request("long")
    engine.abort_request("long")  # a second abort of the same request is not counted
    while engine.has_unfinished_requests():
        engine.step()
    steps, _, _ = engine.step_records.since(start)
    assert len(steps) == 1  # nothing ran: recorded for its events only
    assert (steps[0].aborted, steps[0].finished, steps[0].num_reqs) == (1, 1, 0)
    assert engine.kv_block_states()[0].count(2) == 0  # no block in use after the abort
