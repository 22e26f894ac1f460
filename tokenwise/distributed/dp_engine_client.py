"""The front end of a data-parallel engine: N rank processes behind the `LLMEngine` interface.

`LLM(..., data_parallel_size=N)` and `tokenwise serve --data-parallel-size N` get this object
instead of an `LLMEngine`; it has the methods they use (`add_request`, `abort_request`,
`step`, `has_unfinished_requests`, `groups`, `get_stats`, `tokenizer`), so neither knows
how many engines serve it. Requests are validated here (bad input fails in the caller, as with
one engine), then sent to the least-loaded rank; `step()` collects whatever the ranks produced.

Nothing waits without a bound: start-up has a deadline, every wait for outputs is short, and
each `step()` checks that every rank process is alive. A rank that died (killed, out of memory,
a failed collective) stops all the others and fails the engine with an error naming the rank.
"""

from __future__ import annotations

import copy
import logging
import multiprocessing as mp
import queue
import time
import weakref
from typing import Any

from tokenwise.config import EngineConfig
from tokenwise.distributed.dp_engine_rank import run_dp_rank
from tokenwise.distributed.tp_state import free_port
from tokenwise.engine.prompts import PromptInput, load_tokenizer, validate_request
from tokenwise.engine.stats import EngineStats
from tokenwise.lora.request import LoRARequest
from tokenwise.models.registry import is_moe_architecture
from tokenwise.outputs import RequestOutput
from tokenwise.sampling.params import SamplingParams

logger = logging.getLogger("tokenwise.engine")

START_TIMEOUT_S = 600.0  # every rank loads the model; big checkpoints take minutes
STEP_WAIT_S = 0.05  # one step() waits at most this long for outputs
STOP_TIMEOUT_S = 10.0


class DPEngineClient:
    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        if parallel.data_parallel_size < 2:
            raise ValueError("DPEngineClient needs data_parallel_size >= 2")
        self.config = config
        self.model_config = config.model
        if parallel.is_moe_model is None:
            parallel.is_moe_model = is_moe_architecture(config.model.architectures)
        skip = config.model.skip_tokenizer_init
        self.tokenizer = None if skip else load_tokenizer(config.model)
        self.groups: dict[str, int] = {}  # unfinished request id -> its rank
        self._load = [0] * parallel.data_parallel_size  # sequences in flight per rank
        self._weight: dict[str, int] = {}
        self._stats: list[EngineStats] = [EngineStats() for _ in self._load]
        self.batchsize_stats: list[list[tuple[int, int, float]]] = [[] for _ in self._load]
        self._stopped = False
        self._failure: str | None = None  # why the engine died; every later call says it
        port = parallel.data_parallel_master_port or free_port(parallel.data_parallel_master_ip)
        ctx = mp.get_context("spawn")  # fork would copy torch's threads and locks
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in self._load]
        self._procs = [
            ctx.Process(
                target=run_dp_rank,
                args=(config, rank, parallel.data_parallel_master_ip, port, inbox, self._outbox),
                name=f"tokenwise-dp-{rank}",
                # A daemon may not start processes, and under TP each rank starts its workers;
                # ranks also stop by themselves when this process is gone (`dp_rank`).
                daemon=parallel.tensor_parallel_size == 1,
            )
            for rank, inbox in enumerate(self._inboxes)
        ]
        for proc in self._procs:
            proc.start()
        self._finalizer = weakref.finalize(self, _stop_ranks, self._procs, self._inboxes)
        self._wait_until_ready()

    # ---- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        params = params or SamplingParams()
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        validate_request(self.model_config, self.tokenizer, prompt, params)
        self._check_ranks()
        rank = min(range(len(self._load)), key=self._load.__getitem__)  # least loaded
        self._inboxes[rank].put(("add", request_id, prompt, params, cache_salt, lora_request))
        self.groups[request_id] = rank
        self._weight[request_id] = params.n
        self._load[rank] += params.n

    def abort_request(self, request_ids: str | list[str]) -> None:
        if self._stopped:
            return
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        by_rank: dict[int, list[str]] = {}
        for rid in ids:
            if rid in self.groups:
                by_rank.setdefault(self.groups[rid], []).append(rid)
        for rank, rank_ids in by_rank.items():
            self._inboxes[rank].put(("abort", rank_ids))

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

    def step(self) -> list[RequestOutput]:
        """Outputs the ranks produced since the last call (waits briefly when there are none)."""
        self._check_ranks()
        outputs: list[RequestOutput] = []
        try:
            message = self._outbox.get(timeout=STEP_WAIT_S if self.groups else 0.001)
        except queue.Empty:
            return outputs
        while True:
            self._handle(message, outputs)
            try:
                message = self._outbox.get_nowait()
            except queue.Empty:
                return outputs

    def _handle(self, message: tuple, outputs: list[RequestOutput]) -> None:
        kind, rank = message[0], message[1]
        if kind == "outputs":
            _, _, rank_outputs, stats, batchsize_table = message
            self._stats[rank] = stats
            self.batchsize_stats[rank] = batchsize_table
            for out in rank_outputs:
                if out.finished:
                    self._finish(out.request_id)
            outputs.extend(rank_outputs)
        elif kind == "rejected":
            _, _, request_id, reason = message
            self._finish(request_id)
            outputs.append(RequestOutput(request_id, None, [], [], finished=True, error=reason))
        elif kind == "dead":
            time.sleep(0.2)  # let a peer that died first be seen as dead: it is the cause
            self._fail(self._diagnose({rank: message[2]}))
        else:
            raise RuntimeError(f"unexpected message {kind!r} from data-parallel rank {rank}")

    def _finish(self, request_id: str) -> None:
        rank = self.groups.pop(request_id, None)
        if rank is not None:
            self._load[rank] -= self._weight.pop(request_id, 1)

    # ---- process health -----------------------------------------------------------------------

    def _wait_until_ready(self) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(ready) < len(self._procs):
            self._check_ranks()
            if time.monotonic() > deadline:
                self._fail(
                    f"data-parallel ranks {sorted(set(range(len(self._procs))) - ready)} were not "
                    f"ready within {START_TIMEOUT_S:.0f} s"
                )
            try:
                message = self._outbox.get(timeout=0.2)
            except queue.Empty:
                continue
            if message[0] == "ready":
                ready.add(message[1])
                self._stats[message[1]].num_total_blocks = message[2]
            else:
                self._handle(message, [])
        logger.info("%d data-parallel ranks ready", len(self._procs))

    def _check_ranks(self) -> None:
        if self._stopped:
            raise RuntimeError(self._failure or "the data-parallel engine has been shut down")
        if any(not proc.is_alive() for proc in self._procs):
            self._fail(self._diagnose({}))

    def _diagnose(self, reports: dict[int, str]) -> str:
        """Name the rank that caused a failure, not the first one to notice it.

        When one rank dies, its peers fail in their next collective and report that; a rank
        that died without reporting (killed, out of memory) is the cause, so it is named first.
        """
        try:
            while True:
                message = self._outbox.get_nowait()
                if message[0] == "dead":
                    reports.setdefault(message[1], message[2])
        except queue.Empty:
            pass
        exited = [r for r, proc in enumerate(self._procs) if proc.exitcode is not None]
        silent = [r for r in exited if r not in reports]
        root = silent[0] if silent else min(reports, default=exited[0] if exited else 0)
        proc = self._procs[root]
        text = f"data-parallel rank {root} (pid {proc.pid}) "
        text += "failed" if proc.exitcode is None else f"exited with code {proc.exitcode}"
        if root in reports:
            text += f": {reports[root].splitlines()[0]}"
        text += "; the engine cannot continue"
        others = sorted(set(reports) - {root})
        if others:
            text += f" (rank {others[0]} then failed: {reports[others[0]].splitlines()[0][:300]})"
        return text

    def _fail(self, reason: str) -> None:
        """Stop every rank at once (the survivors may be blocked in a collective with the dead
        one, so asking them politely would only wait for a timeout) and raise."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        self._failure = reason
        self.groups.clear()  # nothing will ever report them: callers must not wait for them
        self.shutdown()
        raise RuntimeError(reason)

    def shutdown(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._finalizer()

    # ---- observability ------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        """Counters summed over ranks; KV usage is the pooled fraction of all ranks' blocks."""
        total = EngineStats()
        for s in self._stats:
            for name in (
                "num_running",
                "num_waiting",
                "num_free_blocks",
                "num_total_blocks",
                "prefix_cache_queries",
                "prefix_cache_hits",
                "prompt_tokens_total",
                "generation_tokens_total",
                "num_preemptions_total",
                "num_steps_total",
                "num_ubatched_steps_total",
                "num_dummy_steps_total",
            ):
                setattr(total, name, getattr(total, name) + getattr(s, name))
            for reason, count in s.finished_reasons.items():
                total.finished_reasons[reason] = total.finished_reasons.get(reason, 0) + count
        if total.num_total_blocks:
            total.kv_cache_usage = 1.0 - total.num_free_blocks / total.num_total_blocks
        return total

    @property
    def rank_pids(self) -> list[int | None]:
        return [proc.pid for proc in self._procs]

    def get_rank_stats(self) -> list[EngineStats]:
        return [copy.deepcopy(s) for s in self._stats]


def _stop_ranks(procs: list[Any], inboxes: list[Any]) -> None:
    """Ask every rank to stop, then make sure: a rank stuck in a collective is terminated."""
    for inbox in inboxes:
        try:
            inbox.put(("stop",))
        except (ValueError, OSError):
            pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=STOP_TIMEOUT_S)
