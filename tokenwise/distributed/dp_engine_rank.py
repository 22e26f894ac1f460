"""One data-parallel rank: a whole engine (scheduler, KV cache, model) in its own process.

The front end (`tokenwise.distributed.dp_engine_client.DPEngineClient`) owns the requests' routing; each
rank owns the state of the requests routed to it and runs the ordinary engine loop on them.
What makes ranks more than N independent engines is the MoE layer: under DP its experts are
spread over the ranks and every forward pass exchanges tokens, so all ranks must run the same
number of forward passes. Each iteration therefore starts with one tiny all-reduce of
"do I have work, am I stopping": when nobody has work nobody runs (ranks wait for requests);
when anybody has work everybody runs one pass, a dummy one on ranks with nothing scheduled.
Dense models need no such agreement and each rank steps on its own.

Messages in (per-rank queue): `("add", id, prompt, params, cache_salt, lora_request)`, `("abort", ids)`,
`("stop",)`. Out (one queue shared by all ranks): `("ready", rank, num_blocks)`,
`("outputs", rank, [RequestOutput], EngineStats, batch-size table)`,
`("rejected", rank, id, message)`, `("dead", rank, message)`.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import traceback
from typing import Any

import torch
import torch.distributed as dist

from tokenwise.batchsize_stats import get_batchsize_forward_time_stats
from tokenwise.config import EngineConfig
from tokenwise.distributed.parallel_state import destroy_dp_group, get_dp_group, init_dp_group
from tokenwise.engine.llm_engine import LLMEngine

logger = logging.getLogger("tokenwise.engine")

IDLE_WAIT_S = 0.02  # lock-step ranks: how long an idle iteration waits for a new request
DENSE_IDLE_WAIT_S = 0.5  # independent ranks: wake on a message or every half second
# A collective waits this long for the other ranks; a long prefill on one rank keeps the
# others waiting in the next all-reduce, so it is generous. A dead rank is noticed sooner by
# the client, which watches the processes and stops the others.
COLLECTIVE_TIMEOUT_S = 300.0


def run_dp_rank(
    config: EngineConfig,
    rank: int,
    master_addr: str,
    master_port: int,
    inbox: Any,
    outbox: Any,
) -> None:
    """Process entry point: join the DP group, build the engine, serve until told to stop."""
    logging.basicConfig(level=logging.INFO, format=f"[DP rank {rank}] %(levelname)s %(message)s")
    try:
        config.parallel.data_parallel_rank = rank
        if not str(config.device).startswith("cuda") and "OMP_NUM_THREADS" not in os.environ:
            # N ranks on one CPU: share the cores instead of each claiming all of them.
            cores = os.cpu_count() or 1
            torch.set_num_threads(max(1, cores // config.parallel.data_parallel_size))
        config.parallel.data_parallel_master_ip = master_addr
        config.parallel.data_parallel_master_port = master_port
        if config.parallel.tensor_parallel_size == 1:
            init_dp_group(
                config.parallel, master_addr, master_port, COLLECTIVE_TIMEOUT_S, config.device
            )
        # else: this rank drives a TP group; its runner starts the TP workers, and all
        # dp * tp processes build the TP and DP groups together (`join_parallel_groups`).
        engine = LLMEngine(config, config.device)
        outbox.put(("ready", rank, engine.runner.num_blocks))
        _RankLoop(engine, rank, inbox, outbox).run()
    except BaseException as exc:  # the client turns this into a clear error for the user
        outbox.put(("dead", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        destroy_dp_group()


class _RankLoop:
    def __init__(self, engine: LLMEngine, rank: int, inbox: Any, outbox: Any) -> None:
        self.engine = engine
        self.rank = rank
        self.inbox = inbox
        self.outbox = outbox
        self.stopping = False
        self.parent = mp.parent_process()

    def run(self) -> None:
        lockstep = self.engine.dp_lockstep
        while True:
            self._apply_messages(block_s=None)
            local = self.engine.has_unfinished_requests()
            if lockstep:
                anyone_working, anyone_stopping = self._agree(local)
                if anyone_stopping:
                    return
                if not anyone_working:
                    self._apply_messages(block_s=IDLE_WAIT_S)
                    continue
            elif self.stopping:
                return
            elif not local:
                self._apply_messages(block_s=DENSE_IDLE_WAIT_S)
                continue
            if local:
                self._publish(self.engine.step())
            else:
                self.engine.execute_dummy_batch()

    def _agree(self, local: bool) -> tuple[bool, bool]:
        """One all-reduce: does any rank have work, is any rank stopping."""
        flags = torch.tensor([int(local), int(self.stopping)], dtype=torch.int32)
        dist.all_reduce(flags, group=get_dp_group())
        return bool(flags[0]), bool(flags[1])

    def _apply_messages(self, block_s: float | None) -> None:
        """Apply every queued message; with `block_s`, wait that long for the first one."""
        if self.parent is not None and not self.parent.is_alive():
            self.stopping = True  # the front end is gone: nobody will read our outputs
            return
        try:
            message = self.inbox.get(timeout=block_s) if block_s else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(message)
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, request_id, prompt, params, cache_salt, lora_request = message
            try:
                self.engine.add_request(request_id, prompt, params, cache_salt, lora_request)
            except Exception as exc:  # validated by the client already: only a bug lands here
                self.outbox.put(("rejected", self.rank, request_id, f"{type(exc).__name__}: {exc}"))
        elif kind == "abort":
            self.engine.abort_request(message[1])
        elif kind == "stop":
            self.stopping = True
        else:
            raise ValueError(f"DP rank {self.rank}: unknown message {kind!r}")

    def _publish(self, outputs: list) -> None:
        stats = self.engine.get_stats()
        self.outbox.put(("outputs", self.rank, outputs, stats, get_batchsize_forward_time_stats()))
