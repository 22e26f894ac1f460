"""The engine loop: requests in, incremental outputs out, one scheduled forward pass per step.

One loop for every model kind: the kind (`engine/kinds/`: generate, embed, encoder-decoder)
supplies the prompt processing, the KV-cache groups, what it adds to the runner, the
scheduler, and the outputs. `add_request` has the kind validate and make the requests (bad input fails there,
with a message naming the problem, before anything is queued; a guided-decoding grammar starts
compiling on a thread, its request waiting in the queue until it is ready); `step` schedules,
runs the model, detokenizes the sampled tokens, has the scheduler append them and apply the
stop rules (freeing finished requests' blocks), and returns the output of every request that
changed. `n > 1` becomes n sibling requests that share the prompt's KV blocks through the
prefix cache.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

from tokenwise.batchsize_stats import get_batchsize_forward_time_summary
from tokenwise.config import EngineConfig
from tokenwise.distributed.kv_events import attach_kv_events
from tokenwise.engine.async_scheduler import scheduler_class
from tokenwise.engine.async_step import make_async_loop
from tokenwise.engine.kinds.base import ModelKind, NewRequest
from tokenwise.engine.kinds.select import model_kind_for
from tokenwise.engine.kv_tier_setup import attach_kv_tier
from tokenwise.engine.output_processor import OutputProcessor, Touched
from tokenwise.engine.pipeline_loop import PipelineLoop
from tokenwise.engine.prompts import (
    PromptInput,
    load_tokenizer,
    resolve_eos_token_ids,
)
from tokenwise.engine.request import Request, RequestStatus
from tokenwise.engine.request_queue import check_priority
from tokenwise.engine.sleep_control import SleepControl
from tokenwise.engine.speculative_setup import make_drafter, make_proposer
from tokenwise.engine.stats import (
    EngineStats,
    StatLogger,
    finished_request_line,
)
from tokenwise.engine.step_outputs import ModelRunnerOutput, SchedulerOutput
from tokenwise.engine.step_records import StepRecorder, StepRecords
from tokenwise.engine.virtual_engines import (
    VirtualEngineBlockManagers,
    VirtualEngineSchedulers,
    check_kv_capacity,
    make_schedulers,
)
from tokenwise.executor.executor import Executor
from tokenwise.executor.worker_main import maybe_serve_torchrun_worker
from tokenwise.lora.request import LoRARequest
from tokenwise.outputs import EmbeddingRequestOutput, RequestOutput
from tokenwise.platform import configure_cpu_allocator
from tokenwise.pooling.params import PoolingParams
from tokenwise.sampling.guided.compiler import GrammarCompileCache, grammar_compile_timeout_s
from tokenwise.sampling.params import SamplingParams

logger = logging.getLogger("tokenwise.engine")

# A failed forward pass fails only its own requests and the engine serves on (a transient out
# of memory on one large batch). This many failures in a row mean the engine itself is broken:
# `step` then raises, so a server exits instead of failing every request it ever receives.
MAX_CONSECUTIVE_FAILED_STEPS = 3
# A step with nothing to run while guided requests wait for their grammars sleeps on the
# compiles for at most this long, instead of spinning on the cores the compiles need.
_GRAMMAR_IDLE_WAIT_S = 0.05


class LLMEngine:
    def __new__(cls, *args: Any, **kwargs: Any) -> LLMEngine:
        # Under torchrun every rank runs the caller's code: a TP rank other than 0 is no
        # engine, so before one is built it serves rank 0's steps and its process exits with
        # status 0 once rank 0 shuts down (`tokenwise.executor.worker_main`). (No config:
        # `copy`/`pickle` making an empty instance.)
        config = args[0] if args else kwargs.get("config")
        if config is not None:
            maybe_serve_torchrun_worker(config)
        return super().__new__(cls)

    def __init__(
        self, config: EngineConfig, device: str = "cpu", kind: type[ModelKind] | None = None
    ) -> None:
        """`kind`: the model kind to serve (`engine/kinds/`); by default the one `config.model`
        is (`model_kind_for`)."""
        if config.model is None:
            raise ValueError("LLMEngine needs EngineConfig.model")
        self.config = config
        self.model_config = config.model
        if not str(device).startswith("cuda"):
            configure_cpu_allocator()
        self.tokenizer = None if config.model.skip_tokenizer_init else load_tokenizer(config.model)
        self.eos_token_ids = resolve_eos_token_ids(config.model, self.tokenizer)
        parallel = config.parallel
        # Under DP an MoE model's layers are collectives: every rank must run one forward pass
        # per step, a dummy one when it has nothing scheduled (see tokenwise.engine.core_process).
        kind_cls = kind or model_kind_for(config)
        self.grammar_timeout_s = grammar_compile_timeout_s()
        self._grammars: GrammarCompileCache | None = None  # made at the first guided request
        pp = parallel.pipeline_parallel_size

        def on_runner(runner: Any) -> None:  # the kind reads the model (before KV sizing)
            self.runner = runner
            self.kind = kind_cls(self)
            self.dp_lockstep = runner.dp_lockstep
            # A draft model's KV group is sized with the target's, in one budget.
            self._proposer = make_proposer(config, self.kind.name, runner)

        # The executor owns the workers (this process's and any it spawns) and runs the
        # start-up sequence on them; `num_blocks` is per virtual engine.
        self.model_executor = Executor.create(
            config,
            device,
            kind_cls.runner_part,
            on_runner,
            lambda n: check_kv_capacity(self.kind, n, pp),
        )
        num_blocks = self.model_executor.num_blocks
        # One block manager and scheduler per virtual engine (one without PP).
        managers = [self.kind.make_block_manager(num_blocks) for _ in range(pp)]
        scheduler_cls = scheduler_class(kind_cls.scheduler_cls, config.scheduler)  # async?
        schedulers = make_schedulers(scheduler_cls, config, managers)
        self.block_manager: Any = managers[0] if pp == 1 else VirtualEngineBlockManagers(managers)
        self.scheduler: Any = schedulers[0] if pp == 1 else VirtualEngineSchedulers(schedulers)
        self.pipeline: PipelineLoop | None = None
        if pp > 1:
            self.pipeline = PipelineLoop(self, self.runner.pipeline, schedulers)
        self._stats = EngineStats(num_total_blocks=num_blocks * pp)
        # The caller's requests (id -> its samples) and what each sample reports.
        self.output_processor = OutputProcessor(self.tokenizer, self._stats)
        self.groups = self.output_processor.groups
        self._consecutive_failed_steps = 0
        self._stat_logger = StatLogger()
        # One record per step for the server's engine view (`step_records`; always on: cheap).
        self.step_recorder = StepRecorder(config.parallel.data_parallel_rank or 0)
        self.step_records: StepRecords = self.step_recorder.records
        self.drafter = make_drafter(config, self._proposer, num_blocks, self.block_manager)
        self.kv_events = attach_kv_events(
            config.kv_events_config, [bm.pool for bm in managers], parallel.data_parallel_rank or 0
        )
        # Sleep mode, paused generation, weight updates and their version (`sleep_control.py`).
        self.sleep_control = SleepControl(
            config.enable_sleep_mode,
            self.model_executor.collective_rpc,
            lambda: not self.groups,
            self.reset_prefix_cache,
        )
        self.kv_tier = attach_kv_tier(config, managers, self.runner)
        self.async_loop = make_async_loop(self, MAX_CONSECUTIVE_FAILED_STEPS)  # None: off

    # ---- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | PoolingParams | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request; bad input raises here (naming the problem), before anything is
        queued. `params` are SamplingParams, or PoolingParams for an embedding model.
        `priority` (lower first) needs `scheduling_policy="priority"` unless it is 0."""
        self.sleep_control.check_serving()
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_priority(priority, self.config.scheduler.policy)
        samples = self.kind.make_requests(
            NewRequest(request_id, prompt, params, cache_salt, lora_request)
        )
        for req, _ in samples:
            req.priority = priority
            self.scheduler.add_request(req)
        # The caller's id -> its samples, until their finished output is made.
        self.output_processor.add(request_id, samples)

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Raise ValueError unless this engine serves LoRA and the adapter loads and fits."""
        manager = self.runner.lora_manager
        if manager is None:
            raise ValueError(
                f"request names LoRA adapter {lora_request.lora_name!r}, but this engine was "
                "started without LoRA support (pass enable_lora=True / --enable-lora)"
            )
        manager.check(lora_request)

    def grammar_cache(self) -> GrammarCompileCache:
        """The engine's grammar compiler and cache (built when first needed)."""
        if self._grammars is None:
            self._grammars = GrammarCompileCache(self.tokenizer, self.model_config.vocab_size)
        return self._grammars

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests (unknown ids are ignored); their blocks are freed at once and the next
        `step()` reports them with finish_reason "abort"."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for rid in ids:
            samples = self.groups.get(rid)
            if samples is not None and not all(r.is_finished for r in samples):
                if self.pipeline is not None:  # not while a batch of theirs is in flight
                    self.pipeline.finish_when_idle(samples, RequestStatus.FINISHED_ABORTED)
                else:
                    self.scheduler.finish_requests(samples, RequestStatus.FINISHED_ABORTED)
                self.step_recorder.num_aborted += 1

    abort = abort_request

    def shutdown(self) -> None:
        """Stop the workers (the executor's); the engine cannot step afterwards."""
        if self.async_loop is not None:
            self.async_loop.shutdown()
        self.model_executor.shutdown()
        self.kv_events.shutdown()
        if self.kv_tier is not None:
            self.kv_tier.close()
        if self._grammars is not None:
            self._grammars.shutdown()
        self.kind.shutdown()

    def collective_rpc(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Run a method on every worker of this engine; results in rank order
        (`Executor.collective_rpc`: method, args, kwargs, timeout; a weight update resets the
        prefix cache, `SleepControl.collective_rpc`)."""
        return self.sleep_control.collective_rpc(*args, **kwargs)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (refused, False, while a request holds blocks); with KV
        events on, `AllBlocksCleared` goes out now rather than at the next step."""
        done = self.block_manager.reset_prefix_cache()
        self.kv_events.end_step()
        return done

    def has_request(self, request_id: str) -> bool:
        return request_id in self.groups

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def execute_dummy_batch(self) -> None:
        """One forward pass of a single dummy token: a DP rank with no work joins its peers'."""
        started = time.perf_counter()
        self.model_executor.execute_dummy_batch()
        self._stats.num_dummy_steps_total += 1
        self.step_recorder.dummy(started, self.block_manager.pool)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ---- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        if self.pipeline is not None:  # P batches in flight, one per virtual engine
            return self.pipeline.step()
        if self.async_loop is not None:  # step N+1 scheduled while step N runs
            return self.async_loop.step()
        started = time.perf_counter()
        sched = self.scheduler.schedule()
        self.step_recorder.begin(sched, started, self._stats)  # before the pass moves tokens
        touched: Touched = {}
        self.warn_aborted(sched)
        if not sched.is_empty:
            try:
                result = self.model_executor.execute_model(sched)
            except Exception as exc:  # keep serving: fail only the requests of this step
                self.step_recorder.forward_done(failed=True)
                if self.dp_lockstep or self.model_executor.is_collective:
                    # Other ranks may be inside a collective this rank left half-way: the
                    # step sequence cannot be resumed, so the rank fails (the client says so).
                    raise
                logger.exception(
                    "model execution failed; failing %d requests", len(sched.scheduled)
                )
                reqs = [s.request for s in sched.scheduled]
                self.scheduler.finish_requests(
                    reqs, RequestStatus.FINISHED_ERROR, discard_cached=True
                )
                for req in reqs:
                    req.error = f"{type(exc).__name__}: {exc}"
                    self.output_processor.touch(req, touched)
                self._consecutive_failed_steps += 1
                if self._consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
                    raise RuntimeError(
                        f"{self._consecutive_failed_steps} forward passes failed in a row; the "
                        f"engine is unusable (last error: {type(exc).__name__}: {exc})"
                    ) from exc
            else:
                self.step_recorder.forward_done()
                self.apply_result(sched, result, touched)
        elif self.dp_lockstep:
            self.execute_dummy_batch()
        else:
            self.wait_for_grammars()
        return self.end_step(sched, touched, sched.num_preempted)

    def warn_aborted(self, sched: SchedulerOutput) -> None:
        for req, reason in sched.aborted:
            logger.warning("aborting request %s: %s", req.request_id, reason)

    def wait_for_grammars(self) -> None:
        """Nothing to run: sleep briefly on guided requests' grammar compiles, if any."""
        compiling = self.scheduler.waiting_grammars()
        if compiling:
            concurrent.futures.wait(
                compiling, _GRAMMAR_IDLE_WAIT_S, concurrent.futures.FIRST_COMPLETED
            )

    def apply_result(
        self, sched: SchedulerOutput, result: ModelRunnerOutput, touched: Touched
    ) -> None:
        """A forward pass's output into the scheduler and its requests (`touched`: by group)."""
        self._consecutive_failed_steps = 0
        for item in sched.scheduled:
            if item.num_new_tokens > 1 or item.request.num_output_tokens == 0:
                self._stats.prompt_tokens_total += item.num_new_tokens
        outputs = self.output_processor
        sampled = self.scheduler.update_from_output(sched, result, outputs.detokenize_token)
        outputs.record_samples(sampled, result, touched)
        if result.prompt_logprobs is not None:
            outputs.record_prompt_logprobs(result.prompt_logprobs)
        if self.drafter is not None:
            self.drafter.record(result, self._stats)
        for req in self.kind.record_pooled(result):
            outputs.touch(req, touched)

    def end_step(
        self, sched: SchedulerOutput, touched: Touched, num_preempted: int
    ) -> list[RequestOutput | EmbeddingRequestOutput]:
        """The step's outputs (every request `touched` or newly finished), its record and
        statistics; `sched` is the step the record describes."""
        if self.drafter is not None:
            self.drafter.propose(self.scheduler.running)
        self._stats.num_steps_total += 1
        self._stats.num_preemptions_total += num_preempted
        self.kv_events.end_step()
        # Aborted or errored requests surface here even if nothing was scheduled for them.
        for rid, samples in self.output_processor.unreported_finished():
            touched[rid] = samples
        outputs = [self._make_output(rid, samples) for rid, samples in touched.items()]
        self.step_recorder.end(self, sched, outputs)
        self._stat_logger.maybe_log(self.get_stats())
        return outputs

    def _make_output(
        self, request_id: str, samples: list[Request]
    ) -> RequestOutput | EmbeddingRequestOutput:
        out = self.kind.make_output(request_id, samples, self.output_processor.outputs_of(samples))
        if isinstance(out, RequestOutput):
            out.weight_version = self.sleep_control.weight_version
        if out.finished:
            self._forget(request_id, samples)
        return out

    def _forget(self, request_id: str, samples: list[Request]) -> None:
        """A finished request leaves the engine: count its finish reasons, drop its records,
        and (`EngineConfig.log_requests`) log its one line: here, once per request, never
        per token, so the log costs nothing measurable."""
        for req in samples:
            reason = req.status.finish_reason or "unknown"
            self._stats.finished_reasons[reason] = self._stats.finished_reasons.get(reason, 0) + 1
        firsts = [o.first_token_time for o in self.output_processor.outputs_of(samples)]
        self.output_processor.forget(request_id)
        if self.config.log_requests and logger.isEnabledFor(logging.INFO):
            line = finished_request_line(request_id, samples, firsts, time.monotonic())
            logger.info("%s", line)

    # ---- observability ------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        tier = self.kv_tier.store.name if self.kv_tier is not None else ""
        return self._stats.refresh(
            self.scheduler,
            self.block_manager,
            kv_tier_name=tier,
            num_ubatched_steps=self.runner.num_ubatched_steps,
            lora=self.config.lora is not None,
        )

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def kv_block_states(self) -> list[bytes]:
        """Per rank (one here), each KV block's state (`BlockPool.block_states`); unlocked."""
        return [self.block_manager.pool.block_states()]

    def wakeup(self) -> None:
        """Nothing to wake: `step()` never waits for outputs, it computes them."""

    def check_health(self) -> None:
        """Raise if a worker of the executor died (the engine itself runs in this thread)."""
        self.model_executor.check_health()

    def forward_time_table(self) -> dict[int, tuple[int, float]]:
        """batch size -> (forward passes, median ms) of this process's forward passes."""
        return get_batchsize_forward_time_summary()
