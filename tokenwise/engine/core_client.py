"""`EngineCoreClient`: engine-core processes behind the `EngineClient` interface.

`tokenwise serve` drives one of these by default (one core), and `LLM(...,
data_parallel_size=N)` / `serve --data-parallel-size N` one with a core per rank; neither knows
how many cores serve it. The client keeps everything that needs no model in the caller's
process: requests are validated and tokenized here, a vision-language model's images processed
into pixels too (bad input fails in the caller, exactly as with an in-process engine), sent to the least-loaded core with their token ids, and their
prompts put back on the outputs that come back (`core_messages`). Detokenization and the stop
rules stay in the core: a stop string ends its request in the very step that completed it, and
the request's KV blocks are freed there, with no extra token generated and no abort round trip.

Nothing waits without a bound: start-up has a deadline, every wait for outputs is short, and
each `step()` (or `check_health()`, which a server calls while idle) checks that every core
process is alive, and that no core on another host lost its connection (`remote_ranks`: with
`data_parallel_size_local < data_parallel_size` this client runs ranks [0, size_local) and the
others connect over TCP from hosts running `tokenwise serve --headless`). A core that died (killed, out of memory, a failed collective) stops all the
others and fails the client with an error naming the core, on this call and every later one.
"""

from __future__ import annotations

import copy
import logging
import pickle
import threading
import time
import weakref
from typing import Any

import zmq

from tokenwise.config import EngineConfig
from tokenwise.distributed.tp_state import free_port
from tokenwise.engine import core_messages as msg
from tokenwise.engine.core_processes import diagnose, name_ranks, start_cores
from tokenwise.engine.core_sockets import CoreSockets, stop_cores
from tokenwise.engine.headless import check_hosts_layout
from tokenwise.engine.kinds.multimodal_prompts import MultiModalPrompts, ProcessedImagePrompt
from tokenwise.engine.prompts import PromptInput, load_tokenizer, validate_request
from tokenwise.engine.ray_ranks import check_ray_layout
from tokenwise.engine.remote_control import RemoteSleepControl
from tokenwise.engine.remote_ranks import cluster_secret, engine_ready_timeout_s
from tokenwise.engine.request_queue import check_priority
from tokenwise.engine.stats import EngineStats, combine_stats
from tokenwise.engine.step_records import StepRecords
from tokenwise.lora.request import LoRARequest
from tokenwise.outputs import EmbeddingRequestOutput, RequestOutput
from tokenwise.sampling.params import SamplingParams

logger = logging.getLogger("tokenwise.engine")

# One step() waits at most this long for outputs; `wakeup()` (a new request to hand over) ends
# the wait at once, so the caller's thread sleeps between steps instead of polling.
STEP_WAIT_S = 0.1
# A control call (sleep, wake-up, a weight update) may read or receive a whole checkpoint.
CONTROL_TIMEOUT_S = 600.0
CHECK_TIMEOUT_S = 120.0  # a question to the core waits for its current step, then a load
_CONFIG_ERRORS = ("ValueError", "TypeError")


class EngineCoreClient:
    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        self.config = config
        self.model_config = config.model
        skip = config.model.skip_tokenizer_init
        self.tokenizer = None if skip else load_tokenizer(config.model)
        # A vision-language model's prompts are processed here, with what its core reports
        # when ready (`multimodal_prompts` says why here); None for a text model.
        self.image_prompts: MultiModalPrompts | None = None
        num_cores = parallel.data_parallel_size
        self._dp = num_cores > 1
        if parallel.spans_hosts and parallel.data_parallel_start_rank != 0:
            raise ValueError(
                "data_parallel_start_rank must be 0 where the front end runs (rank 0 runs "
                f"beside it), got {parallel.data_parallel_start_rank}; the other hosts run "
                "`tokenwise serve --headless`"
            )
        check_hosts_layout(parallel)
        if parallel.ray_data_parallel:
            check_ray_layout(config)
        self._ready_timeout_s = engine_ready_timeout_s()
        # Unfinished request id -> (its core, its weight in sequences, prompt text, token ids).
        self.groups: dict[str, tuple[int, int, str | None, list[int]]] = {}
        self._load = [0] * num_cores  # sequences in flight per core
        self._stats: list[EngineStats] = [EngineStats() for _ in range(num_cores)]
        # Per core: batch size -> (forward passes, median ms), and the sizes seen more than once
        # as (size, count, median) rows, as `batchsize_stats` logs them.
        self._forward_times: list[dict[int, tuple[int, float]]] = [{} for _ in range(num_cores)]
        self.batchsize_stats: list[list[tuple[int, int, float]]] = [[] for _ in range(num_cores)]
        # Every core's step records as they arrive (bounded), and each core's latest KV block
        # states: what the server's engine view shows.
        self.step_records = StepRecords()
        self._kv_blocks: list[bytes] = [b"" for _ in range(num_cores)]
        self._stopped = False
        self._failure: str | None = None  # why the client died; every later call says it
        if self._dp:
            ip = parallel.data_parallel_master_ip
            cluster_secret(ip, "data_parallel_address")  # beyond loopback: only with a secret
            parallel.data_parallel_master_port = parallel.data_parallel_master_port or free_port(ip)
        self._io = CoreSockets(config, id(self))
        self._wake_lock = threading.Lock()
        self._control_lock = threading.Lock()
        try:
            self._procs = start_cores(config, self._io, self._dp)
        except BaseException:  # e.g. Ray could not place the ranks: free the bound ports
            self._io.close()
            raise
        self._finalizer = weakref.finalize(self, stop_cores, self._procs, self._io)
        self._wait_until_ready()
        # Sleep mode, pause and weight updates (`engine/sleep_control.py`): one core only.
        self.sleep_control: RemoteSleepControl | None = (
            None if self._dp else RemoteSleepControl(self._control_call)
        )

    # ---- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> None:
        params = params or SamplingParams()
        if self.sleep_control is not None:
            self.sleep_control.check_serving()
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_priority(priority, self.config.scheduler.policy)
        wire_prompt: Any
        if self.image_prompts is not None:
            text, token_ids, extra = self.image_prompts.process(prompt, params)
            wire_prompt = ProcessedImagePrompt(text, token_ids, extra)
        else:
            text, token_ids = validate_request(self.model_config, self.tokenizer, prompt, params)
            # The core gets token ids: it never tokenizes.
            wire_prompt = {"prompt": text, "prompt_token_ids": token_ids}
        self.check_health()
        rank = min(range(len(self._load)), key=self._load.__getitem__)  # least loaded
        message = msg.add_request(
            request_id, wire_prompt, params, cache_salt, lora_request, priority
        )
        self._io.inboxes[rank].send(msg.encode(message))
        self.groups[request_id] = (rank, params.n, text, token_ids)
        self._load[rank] += params.n

    def abort_request(self, request_ids: str | list[str]) -> None:
        if self._stopped:
            return
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        by_rank: dict[int, list[str]] = {}
        for rid in ids:
            if rid in self.groups:
                by_rank.setdefault(self.groups[rid][0], []).append(rid)
        for rank, rank_ids in by_rank.items():
            self._io.inboxes[rank].send(msg.encode(msg.AbortRequests(rank_ids)))

    abort = abort_request

    def has_request(self, request_id: str) -> bool:
        return request_id in self.groups

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ---- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """Outputs the cores produced since the last call (waits briefly when there are none)."""
        self.check_health()
        outputs: list[RequestOutput | EmbeddingRequestOutput] = []
        wait_ms = int(STEP_WAIT_S * 1000) if self.groups else 1
        ready = dict(self._io.poller.poll(wait_ms))
        if self._io.wake_rx in ready:
            while self._io.wake_rx.poll(0):
                self._io.wake_rx.recv()
        if self._io.outbox not in ready:
            return outputs
        return self._read_outbox()

    @property
    def output_fd(self) -> int:
        """A file descriptor that becomes readable when outputs may have arrived: an event loop
        can watch it and call `drain()` (what the server does, so no thread sits in `step()`).
        ZeroMQ signals it on edges: `drain()` reads until nothing is left."""
        return int(self._io.outbox.getsockopt(zmq.FD))

    def drain(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """Every output that has arrived, without waiting (raises if a core died)."""
        self.check_health()
        return self._read_outbox()

    def _read_outbox(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        outputs: list[RequestOutput | EmbeddingRequestOutput] = []
        while True:
            try:
                frame = self._io.outbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return outputs
            self._handle(msg.decode_from_core(frame), outputs)

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Raise ValueError unless the adapter loads and fits the model (asked of core 0, which
        answers between two steps). From any thread; a server checks adapters it loads."""
        question = msg.CheckLoRA(pickle.dumps(lora_request))
        answer = self._ask(question, f"check adapter {lora_request.lora_name!r}", CHECK_TIMEOUT_S)
        if not isinstance(answer, msg.LoRAChecked):
            raise RuntimeError(f"unexpected answer {type(answer).__name__} from the engine core")
        if answer.error is not None:
            raise ValueError(answer.error)

    def _control_call(self, method: str, args: tuple) -> msg.ControlDone:
        """One `SleepControl` call in the core (`RemoteSleepControl` sends them)."""
        answer = self._ask(
            msg.ControlCall(method, pickle.dumps(args)), f"run {method!r}", CONTROL_TIMEOUT_S
        )
        if not isinstance(answer, msg.ControlDone):
            raise RuntimeError(f"unexpected answer {type(answer).__name__} from the engine core")
        return answer

    def collective_rpc(self, *args: Any) -> list[Any]:
        """`LLMEngine.collective_rpc`, run by the core (a method name, or a module-level
        function); a single core only."""
        if self.sleep_control is None:
            raise NotImplementedError("collective_rpc does not reach data-parallel ranks yet")
        return self.sleep_control.collective_rpc(*args)

    def _ask(self, question: msg.ToCore, what: str, timeout_s: float) -> msg.FromCore:
        """Ask core 0 on the control socket and wait (bounded) for its answer."""
        with self._control_lock:
            self.check_health()
            self._io.control.send(msg.encode(question))
            deadline = time.monotonic() + timeout_s
            while not self._io.control.poll(200):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the engine core did not {what} within {timeout_s:.0f} s")
                if any(not proc.is_alive() for proc in self._procs):
                    raise RuntimeError(f"the engine core died while asked to {what}")
            return msg.decode_from_core(self._io.control.recv())

    def wakeup(self) -> None:
        """End a `step()` that is waiting for outputs (from any thread): a caller with a new
        request or abort to hand over gets the loop back at once."""
        with self._wake_lock:
            if not self._stopped:
                try:
                    self._io.wake_tx.send(b"", zmq.NOBLOCK)
                except zmq.Again:  # wake-ups already queued: one is enough
                    pass

    def _handle(self, message: msg.FromCore, outputs: list) -> None:
        if isinstance(message, msg.CoreOutputs):
            rank = message.rank
            self._stats[rank] = message.stats
            self.step_records.extend(message.steps)
            if message.kv_blocks is not None:
                self._kv_blocks[rank] = message.kv_blocks
            if message.forward_times is not None:
                self._forward_times[rank] = message.forward_times
                self.batchsize_stats[rank] = [
                    (size, count, median)
                    for size, (count, median) in sorted(message.forward_times.items())
                    if count > 1
                ]
            for out in message.outputs:
                record = self.groups.get(out.request_id)
                if record is not None:
                    out.prompt, out.prompt_token_ids = record[2], record[3]
                if out.finished:
                    self._finish(out.request_id)
                outputs.append(out)
            for out in message.embeddings:
                self._finish(out.request_id)
                outputs.append(out)
        elif isinstance(message, msg.CoreRejected):
            record = self.groups.get(message.request_id)
            prompt, ids = (record[2], record[3]) if record is not None else (None, [])
            self._finish(message.request_id)
            outputs.append(
                RequestOutput(
                    message.request_id, prompt, ids, [], finished=True, error=message.message
                )
            )
        elif isinstance(message, msg.CoreDead):
            time.sleep(0.2)  # let a peer that died first be seen as dead: it is the cause
            self._fail(diagnose(self._procs, self._io, {message.rank: message.message}, self._dp))
        else:
            raise RuntimeError(f"unexpected message {type(message).__name__} from an engine core")

    def _finish(self, request_id: str) -> None:
        record = self.groups.pop(request_id, None)
        if record is not None:
            self._load[record[0]] -= record[1]

    # ---- process health -----------------------------------------------------------------------

    def _wait_until_ready(self) -> None:
        ready: set[int] = set()
        timeout = self._ready_timeout_s
        deadline = time.monotonic() + timeout
        while len(ready) < len(self._load):
            self.check_health()
            if time.monotonic() > deadline:
                local_missing = sorted(set(range(len(self._procs))) - ready)
                reasons = []
                if local_missing:
                    reasons.append(
                        f"{name_ranks(local_missing, self._dp)} not ready within {timeout:g} s"
                    )
                if self._io.remote is not None:
                    reasons.append(self._io.remote.describe_missing(ready, timeout))
                self._fail("; ".join(r for r in reasons if r))
            if not self._io.outbox.poll(50 if self._io.remote is not None else 200):
                continue
            message = msg.decode_from_core(self._io.outbox.recv())
            if isinstance(message, msg.CoreReady):
                ready.add(message.rank)
                # Every block is free until the core's first stats (sent after a step).
                stats = self._stats[message.rank]
                stats.num_total_blocks = stats.num_free_blocks = message.num_blocks
                self._kv_blocks[message.rank] = bytes(message.num_blocks)  # all free
                if message.prompt_settings and self.image_prompts is None:
                    self.image_prompts = MultiModalPrompts(
                        self.model_config, self.tokenizer, message.prompt_settings
                    )
            elif isinstance(message, msg.CoreDead) and message.error_type in _CONFIG_ERRORS:
                # A core refused the configuration (a KV cache too small, an unknown option):
                # the caller's mistake, raised as such (the CLI prints it, no traceback).
                for proc in self._procs:
                    proc.kill()
                self._failure = message.message.splitlines()[0]
                self.shutdown()
                reason = self._failure.removeprefix(f"{message.error_type}: ")
                if message.rank >= len(self._procs) and self._io.remote is not None:
                    reason = f"{self._io.remote.describe(message.rank)}: {reason}"
                raise ValueError(reason)
            else:
                self._handle(message, [])
        logger.info("%s ready", name_ranks(sorted(ready), self._dp))

    def check_health(self) -> None:
        """Raise (after stopping every core) if the client was stopped or any core is gone."""
        if self._stopped:
            raise RuntimeError(self._failure or "the engine has been shut down")
        if any(not proc.is_alive() for proc in self._procs):
            self._fail(diagnose(self._procs, self._io, {}, self._dp))
        if self._io.remote is not None and self._io.remote.poll() is not None:
            self._fail(diagnose(self._procs, self._io, {}, self._dp))

    def _fail(self, reason: str) -> None:
        """Stop every core at once (the survivors may be blocked in a collective with the dead
        one, so asking them politely would only wait for a timeout) and raise."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        self._failure = reason
        self.groups.clear()  # nothing will ever report them: callers must not wait for them
        self.shutdown()
        raise RuntimeError(reason)

    def shutdown(self) -> None:
        with self._wake_lock:  # no wakeup() on a socket being closed
            if self._stopped:
                return
            self._stopped = True
        self._finalizer()

    # ---- observability ------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        """Counters summed over cores; KV usage is the pooled fraction of all cores' blocks."""
        return combine_stats(self._stats)

    def forward_time_table(self) -> dict[int, tuple[int, float]]:
        """batch size -> (forward passes, median ms) as the first core last reported it (the
        server's `/metrics`; forward times are per process, so they come from the core)."""
        return dict(self._forward_times[0])

    def kv_block_states(self) -> list[bytes]:
        """Per core, each KV block's state as it last sent them (`BlockPool.block_states`)."""
        return list(self._kv_blocks)

    @property
    def rank_pids(self) -> list[int | None]:
        return [proc.pid for proc in self._procs]

    def get_rank_stats(self) -> list[EngineStats]:
        return [copy.deepcopy(s) for s in self._stats]
