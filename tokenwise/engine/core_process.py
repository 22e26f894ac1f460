"""The engine core: one whole engine (scheduler, KV cache, model) in its own process.

The client (`tokenwise.engine.core_client.EngineCoreClient`) lives in the caller's process (the
API server's) and does what needs no model: validation, tokenization, routing, re-attaching
prompts; the core only schedules and runs steps, so nothing else competes with it for the
interpreter lock. One client drives one core, or one core per data-parallel rank.

What makes DP ranks more than N independent cores is the MoE layer: under DP its experts are
spread over the ranks and every forward pass exchanges tokens, so all ranks must run the same
number of forward passes. Each iteration then starts with one tiny all-reduce of "do I have
work, am I stopping": when nobody has work nobody runs (ranks wait for requests); when anybody
has work everybody runs one pass, a dummy one on ranks with nothing scheduled. A dense model's
ranks, and a single core, step on their own.

Messages (`core_messages`) travel over ZeroMQ: one PUSH socket from the client to each core and
one PULL socket at the client that every core pushes to. A core whose parent process is gone
stops by itself: nobody would read its outputs.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import zmq

from tokenwise import envs
from tokenwise.batchsize_stats import get_batchsize_forward_time_summary
from tokenwise.config import EngineConfig
from tokenwise.distributed.parallel_state import destroy_dp_group, get_dp_group, init_dp_group
from tokenwise.engine import core_messages as msg
from tokenwise.engine.llm_engine import LLMEngine
from tokenwise.engine.remote_control import answer_control_call
from tokenwise.outputs import EmbeddingRequestOutput, RequestOutput

logger = logging.getLogger("tokenwise.engine")

IDLE_WAIT_S = 0.02  # lock-step ranks: how long an idle iteration waits for a new request
DENSE_IDLE_WAIT_S = 0.5  # independent cores: wake on a message or every half second
FORWARD_TIMES_EVERY_S = 1.0  # the forward-time table goes to the client at most this often
# A collective waits this long for the other ranks; a long prefill on one rank keeps the
# others waiting in the next all-reduce, so it is generous. A dead rank is noticed sooner by
# the client, which watches the processes and stops the others.
COLLECTIVE_TIMEOUT_S = 300.0


def run_engine_core(
    config: EngineConfig,
    rank: int,
    input_address: str,
    output_address: str,
    control_address: str,
) -> None:
    """Process entry point: build the engine (joining the DP group if any), serve until told to
    stop or the parent is gone."""
    _log_as(config, rank)
    context = zmq.Context()
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)  # the last words (outputs, "dead") must get out
    outbox.connect(output_address)
    inbox = context.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.connect(input_address)
    control = context.socket(zmq.REP)  # questions that need an answer now (`CheckLoRA`)
    control.setsockopt(zmq.LINGER, 0)
    control.connect(control_address)
    try:
        serve_engine_core(config, rank, inbox, outbox, control)
    finally:
        context.term()


def _log_as(config: EngineConfig, rank: int) -> None:
    prefix = f"[DP rank {rank}]" if config.parallel.data_parallel_size > 1 else "[engine core]"
    logging.basicConfig(level=logging.INFO, format=f"{prefix} %(levelname)s %(message)s")


def serve_engine_core(
    config: EngineConfig,
    rank: int,
    inbox: zmq.Socket,
    outbox: zmq.Socket,
    control: zmq.Socket,
    front_end_lost: Callable[[], bool] | None = None,
) -> None:
    """Join the DP group, build the engine, say ready and serve; report any failure on the
    outbox, then close these sockets. `front_end_lost` (a core on another host) says whether
    the front end's connection broke: such a core has no parent process to watch."""
    dp = config.parallel.data_parallel_size
    try:
        if dp > 1:
            config.parallel.data_parallel_rank = rank
            if (
                not str(config.device).startswith("cuda")
                and envs.external("OMP_NUM_THREADS") is None
            ):
                # N ranks on one CPU: share the cores instead of each claiming all of them.
                local = config.parallel.local_dp_size
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
            if config.parallel.tensor_parallel_size == 1:
                parallel = config.parallel
                init_dp_group(
                    parallel,
                    parallel.data_parallel_master_ip,
                    parallel.data_parallel_master_port,
                    COLLECTIVE_TIMEOUT_S,
                    config.device,
                )
            # else: this rank drives a TP group; its runner starts the TP workers, and all
            # dp * tp processes build the TP and DP groups together (`join_parallel_groups`).
        engine = LLMEngine(config, config.device)
        settings = engine.kind.prompt_settings()
        outbox.send(msg.encode(msg.CoreReady(rank, engine.runner.num_blocks, settings)))
        _CoreLoop(engine, rank, inbox, outbox, control, front_end_lost).run()
    except BaseException as exc:  # the client turns this into a clear error for the user
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        outbox.send(msg.encode(msg.CoreDead(rank, text, type(exc).__name__)))
        raise SystemExit(1) from None
    finally:
        destroy_dp_group()
        inbox.close()
        control.close()
        outbox.close()


@dataclass
class _CoreLoop:
    """One core's serving loop over its sockets (see `serve_engine_core`)."""

    engine: LLMEngine
    rank: int
    inbox: zmq.Socket
    outbox: zmq.Socket
    control: zmq.Socket
    front_end_lost: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.poller.register(self.control, zmq.POLLIN)
        self.stopping = False
        self.parent = mp.parent_process()
        self._forward_times_sent = 0.0
        self._records_sent = 0  # cursor into the engine's step records

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
                self.engine.check_health()  # a worker that died while idle
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
        parent_gone = self.parent is not None and not self.parent.is_alive()
        if parent_gone or (self.front_end_lost is not None and self.front_end_lost()):
            self.stopping = True  # the client is gone: nobody will read our outputs
            return
        if block_s and not self.poller.poll(int(block_s * 1000)):
            return
        while self.control.poll(0):
            self._answer(msg.decode_to_core(self.control.recv()))
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._apply(msg.decode_to_core(frame))

    def _apply(self, message: msg.ToCore) -> None:
        if isinstance(message, msg.AddRequest):
            try:
                prompt, params, cache_salt, lora = msg.add_request_fields(message)
                self.engine.add_request(
                    message.request_id, prompt, params, cache_salt, lora, message.priority
                )
            except Exception as exc:  # what only the core can check (an adapter that fails)
                reason = f"{type(exc).__name__}: {exc}"
                self._send(msg.CoreRejected(self.rank, message.request_id, reason))
        elif isinstance(message, msg.AbortRequests):
            self.engine.abort_request(message.request_ids)
        else:
            self.stopping = True

    def _answer(self, question: msg.ToCore) -> None:
        error = None
        if isinstance(question, msg.ControlCall):
            self.control.send(msg.encode(answer_control_call(self.engine.sleep_control, question)))
            return
        if isinstance(question, msg.CheckLoRA):
            try:
                self.engine.check_lora(pickle.loads(question.payload))
            except (ValueError, TypeError, OSError) as exc:
                error = str(exc)
        else:
            error = f"unexpected question {type(question).__name__}"
        self.control.send(msg.encode(msg.LoRAChecked(error)))

    def _publish(self, outputs: list) -> None:
        generated = [o for o in outputs if isinstance(o, RequestOutput)]
        embeddings = [o for o in outputs if isinstance(o, EmbeddingRequestOutput)]
        now = time.monotonic()
        forward_times = kv_blocks = None
        finished = any(o.finished for o in outputs)
        if finished or now - self._forward_times_sent >= FORWARD_TIMES_EVERY_S:
            self._forward_times_sent = now
            forward_times = get_batchsize_forward_time_summary()
            kv_blocks = self.engine.kv_block_states()[0]
        records, self._records_sent, _ = self.engine.step_records.since(self._records_sent)
        self._send(
            msg.CoreOutputs(
                self.rank,
                msg.strip_prompts(generated),
                self.engine.get_stats(),
                forward_times,
                embeddings,
                records,
                kv_blocks,
            )
        )

    def _send(self, message: msg.FromCore) -> None:
        self.outbox.send(msg.encode(message))
