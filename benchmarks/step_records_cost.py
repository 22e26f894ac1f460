"""What the always-on step records cost per engine step (`tokenwise.engine.step_records`).

    python benchmarks/step_records_cost.py [--reqs 1 32 256] [--steps 20000] [--rounds 5]

Per step the engine calls `StepRecorder.begin` (the prefill/decode split: one pass over the
scheduled requests), `forward_done` and `end` (one `StepRecord` into the ring). In the server
the engine-core process also sends the record to the front end inside the step's
`CoreOutputs` message, and the front end adds it to its own ring. Each part is timed here on
its own, with the engine's real `BlockPool` and the engine's objects' shapes (requests that
decode, a step's outputs), for steps of 1, 32 and 256 requests:

- `record`: begin + forward_done + end, what `LLMEngine.step` adds;
- `wire`: msgpack encode + decode of one record (the `CoreOutputs` of a step, with the record
  minus without it) plus the front end's ring append;
- memory: bytes per record held in the ring (tracemalloc over a full ring).

Each figure is the smallest of the rounds' means (the machine is shared). Compare them with a
step's own time: a decode step of the built-in model takes ~1-3 ms on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenwise.config import CUDAGraphMode  # noqa: E402
from tokenwise.engine import core_messages as msg  # noqa: E402
from tokenwise.engine.block_pool import BlockPool  # noqa: E402
from tokenwise.engine.stats import EngineStats  # noqa: E402
from tokenwise.engine.step_records import StepRecorder, StepRecords  # noqa: E402


def fake_step(num_reqs: int) -> tuple[SimpleNamespace, SimpleNamespace, list]:
    """A decode step of `num_reqs` requests, the engine around it, and its outputs."""
    scheduled = [
        SimpleNamespace(
            num_new_tokens=1,
            spec_token_ids=[],
            request=SimpleNamespace(num_output_tokens=5, num_computed_tokens=20, num_tokens=21),
        )
        for _ in range(num_reqs)
    ]
    sched = SimpleNamespace(scheduled=scheduled, aborted=[], num_preempted=0, is_empty=False)
    pool = BlockPool(4096)
    for _ in range(num_reqs * 2):
        pool.allocate()
    engine = SimpleNamespace(
        runner=SimpleNamespace(last_graph=(CUDAGraphMode.NONE, None)),
        block_manager=SimpleNamespace(pool=pool),
        scheduler=SimpleNamespace(running=scheduled, waiting=[]),
    )
    outputs = [SimpleNamespace(finished=False) for _ in range(num_reqs)]
    return sched, engine, outputs


def time_record(num_reqs: int, steps: int) -> float:
    sched, engine, outputs = fake_step(num_reqs)
    recorder = StepRecorder(capacity=2048)
    stats = EngineStats()
    start = time.perf_counter()
    for _ in range(steps):
        recorder.begin(sched, time.perf_counter(), stats)
        recorder.forward_done()
        recorder.end(engine, sched, outputs)
    return (time.perf_counter() - start) / steps * 1e6


def time_wire(steps: int) -> float:
    sched, engine, outputs = fake_step(1)
    recorder = StepRecorder(capacity=8)
    recorder.begin(sched, time.perf_counter(), EngineStats())
    recorder.forward_done()
    recorder.end(engine, sched, outputs)
    records = recorder.records.since(0)[0]
    front = StepRecords(capacity=2048)
    stats = EngineStats()
    with_record = msg.CoreOutputs(0, [], stats, steps=records)
    without = msg.CoreOutputs(0, [], stats)

    def run(message: msg.CoreOutputs, keep: bool) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            got = msg.decode_from_core(msg.encode(message))
            if keep:
                front.extend(got.steps)
        return time.perf_counter() - start

    return (run(with_record, True) - run(without, False)) / steps * 1e6


def bytes_per_record(capacity: int = 2048) -> float:
    sched, engine, outputs = fake_step(32)
    recorder = StepRecorder(capacity=capacity)
    stats = EngineStats()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(capacity):
        recorder.begin(sched, time.perf_counter(), stats)
        recorder.forward_done()
        recorder.end(engine, sched, outputs)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / capacity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reqs", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for num_reqs in args.reqs:
        best = min(time_record(num_reqs, args.steps) for _ in range(args.rounds))
        print(f"record, {num_reqs:>3} requests per step: {best:6.2f} us per step")
    wire = min(time_wire(args.steps) for _ in range(args.rounds))
    print(f"wire (core -> front end, one record):  {wire:6.2f} us per step")
    print(f"memory: {bytes_per_record():.0f} bytes per record held")


if __name__ == "__main__":
    main()
