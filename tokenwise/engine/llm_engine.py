"""The engine loop: requests in, incremental outputs out, one scheduled forward pass per step.

`add_request` tokenizes and validates (bad input fails there, with a message naming the
problem, before anything is queued; a guided-decoding spec is parsed there and its grammar
compiled on a thread, the request waiting in the queue until it is ready); `step` schedules, runs the model, appends sampled tokens,
detokenizes, applies stop conditions, frees finished requests' blocks and returns the new text
and tokens of every request that changed. `n > 1` becomes n sibling sequences that share the
prompt's KV blocks through the prefix cache.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tokenwise.config import EngineConfig
from tokenwise.engine.block_manager import BlockManager
from tokenwise.engine.detokenizer import IncrementalDetokenizer
from tokenwise.engine.kinds.encoder_inputs import EncoderInputs
from tokenwise.engine.prompts import (
    PromptInput,
    load_tokenizer,
    resolve_eos_token_ids,
    validate_request,
)
from tokenwise.engine.request import Request, RequestStatus
from tokenwise.engine.scheduler import Scheduler
from tokenwise.engine.stats import EngineStats, StatLogger
from tokenwise.engine.step_outputs import ModelRunnerOutput
from tokenwise.lora.request import LoRARequest
from tokenwise.models.registry import is_moe_architecture
from tokenwise.outputs import CompletionOutput, Logprob, RequestOutput
from tokenwise.platform import configure_cpu_allocator
from tokenwise.runner.memory_profiling import check_kv_cache_holds_one_sequence
from tokenwise.runner.model_runner import ModelRunner
from tokenwise.sampling.guided.compiler import GrammarCompileCache, grammar_compile_timeout_s
from tokenwise.sampling.guided.state import GrammarState
from tokenwise.sampling.params import SamplingParams

logger = logging.getLogger("tokenwise.engine")

# A failed forward pass fails only its own requests and the engine serves on (a transient out
# of memory on one large batch). This many failures in a row mean the engine itself is broken:
# `step` then raises, so a server exits instead of failing every request it ever receives.
MAX_CONSECUTIVE_FAILED_STEPS = 3
# A step with nothing to run while guided requests wait for their grammars sleeps on the
# compiles for at most this long, instead of spinning on the cores the compiles need.
_GRAMMAR_IDLE_WAIT_S = 0.05


@dataclass(eq=False)
class _Sample:
    request: Request
    index: int
    detokenizer: IncrementalDetokenizer | None
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    reported_finish: bool = False


@dataclass(eq=False)
class _RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    arrival_time: float
    first_token_time: float | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)


class LLMEngine:
    # The embedding engine (`engine/kinds/pooling.py`) swaps these for its own: a runner that
    # pools instead of sampling, and a scheduler of whole prompts with no KV blocks.
    runner_cls: type[ModelRunner] = ModelRunner
    scheduler_cls: type[Scheduler] = Scheduler

    def __init__(self, config: EngineConfig, device: str = "cpu") -> None:
        if config.model is None:
            raise ValueError("LLMEngine needs EngineConfig.model")
        self.config = config
        self.model_config = config.model
        if not str(device).startswith("cuda"):
            configure_cpu_allocator()
        self.tokenizer = None if config.model.skip_tokenizer_init else load_tokenizer(config.model)
        self.eos_token_ids = resolve_eos_token_ids(config.model, self.tokenizer)
        parallel = config.parallel
        if parallel.is_moe_model is None:
            parallel.is_moe_model = is_moe_architecture(config.model.architectures)
        # Under DP an MoE model's layers are collectives: every rank must run one forward pass
        # per step, a dummy one when it has nothing scheduled (see tokenwise.distributed.dp_engine_rank).
        self.runner = self.runner_cls(config, device)
        self.dp_lockstep = self.runner.dp_lockstep
        num_blocks = self.runner.determine_num_blocks()
        self._check_kv_capacity(num_blocks)
        self.runner.initialize_kv_cache(num_blocks)
        if not self.runner.tp.is_driver:
            # A torchrun-launched TP rank other than 0: it serves the driver's steps and
            # leaves with it; only rank 0 goes on to be the engine the caller asked for.
            self.runner.serve_tp_steps()
            raise SystemExit(0)
        self.block_manager = self._make_block_manager(num_blocks)
        max_loras = config.lora.max_loras if config.lora is not None else None
        self.scheduler = self.scheduler_cls(
            config.scheduler, self.block_manager, config.model.max_model_len, max_loras
        )
        self.groups: dict[str, _RequestGroup] = {}
        self._by_request: dict[str, tuple[_RequestGroup, _Sample]] = {}
        self._stats = EngineStats(num_total_blocks=num_blocks)
        self._consecutive_failed_steps = 0
        self._stat_logger = StatLogger()
        self.grammar_timeout_s = grammar_compile_timeout_s()
        self._grammars: GrammarCompileCache | None = None  # made at the first guided request

    def _check_kv_capacity(self, num_blocks: int) -> None:
        cache, model = self.config.cache, self.model_config
        check_kv_cache_holds_one_sequence(num_blocks, cache.block_size, model.max_model_len)

    def _make_block_manager(self, num_blocks: int) -> BlockManager:
        return BlockManager(num_blocks, self.config.cache.block_size)

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
        text, token_ids, encoder_inputs = self._process_prompt(prompt, params)
        if lora_request is not None:
            self.check_lora(lora_request)
            # Blocks computed under one adapter hold other K/V than the base model's: the
            # adapter's id keys the prefix cache, so no two adapters ever share a block.
            cache_salt = f"{cache_salt or ''}|lora:{lora_request.lora_int_id}"
        compiled = None
        if params.guided_decoding is not None:
            compiled = self.grammar_cache().submit(params.guided_decoding)
        if not self.config.cache.enable_prefix_caching or encoder_inputs is not None:
            # Siblings of one request still share their prompt blocks; nobody else can hit them.
            # (A decoder's K/V depends on its encoder's input too, not on its tokens alone.)
            cache_salt = f"{cache_salt or ''}/{uuid.uuid4().hex}"
        samples = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.clone()
                child_params.seed = params.seed + i
            sub_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(
                request_id=sub_id,
                prompt_token_ids=token_ids,
                sampling_params=child_params,
                eos_token_ids=self.eos_token_ids,
                cache_salt=cache_salt,
                lora_request=lora_request,
                encoder_inputs=encoder_inputs,
            )
            if compiled is not None:
                req.grammar = GrammarState(compiled, self.eos_token_ids, self.grammar_timeout_s)
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    token_ids,
                    params.stop,
                    params.include_stop_str_in_output,
                    params.skip_special_tokens,
                )
            samples.append(_Sample(req, i, detok))
        group = _RequestGroup(request_id, text, token_ids, samples, time.monotonic())
        for sample in samples:
            self.scheduler.add_request(sample.request)
        self.groups[request_id] = group
        for sample in samples:
            self._by_request[sample.request.request_id] = (group, sample)

    def _process_prompt(
        self, prompt: PromptInput, params: SamplingParams
    ) -> tuple[str | None, list[int], EncoderInputs | None]:
        """(prompt text, prompt token ids, encoder inputs): decoder-only models have none."""
        return (*validate_request(self.model_config, self.tokenizer, prompt, params), None)

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
            group = self.groups.get(rid)
            if group is None:
                continue
            self.scheduler.finish_requests(
                [s.request for s in group.samples], RequestStatus.FINISHED_ABORTED
            )

    abort = abort_request

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (if any); the engine cannot step afterwards."""
        self.runner.shutdown()
        if self._grammars is not None:
            self._grammars.shutdown()

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def execute_dummy_batch(self) -> None:
        """One forward pass of a single dummy token: a DP rank with no work joins its peers'."""
        self.runner.execute_dummy_batch()
        self._stats.num_dummy_steps_total += 1

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ---- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        touched: dict[str, _RequestGroup] = {}
        for req, reason in sched.aborted:
            logger.warning("aborting request %s: %s", req.request_id, reason)
        if not sched.is_empty:
            try:
                result = self.runner.execute_model(sched)
            except Exception as exc:  # keep serving: fail only the requests of this step
                if self.dp_lockstep or self.runner.tp.active:
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
                    group, _ = self._by_request[req.request_id]
                    touched[group.request_id] = group
                    group.error = f"{type(exc).__name__}: {exc}"
                self._consecutive_failed_steps += 1
                if self._consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
                    raise RuntimeError(
                        f"{self._consecutive_failed_steps} forward passes failed in a row; the "
                        f"engine is unusable (last error: {type(exc).__name__}: {exc})"
                    ) from exc
            else:
                self._consecutive_failed_steps = 0
                for item in sched.scheduled:
                    if item.num_new_tokens > 1 or item.request.num_output_tokens == 0:
                        self._stats.prompt_tokens_total += item.num_new_tokens
                sampled = self.scheduler.update_from_output(sched, result, self._stop_string)
                self._route_samples(sampled, result, touched)
        elif self.dp_lockstep:
            self.execute_dummy_batch()
        else:
            compiling = self.scheduler.waiting_grammars()
            if compiling:
                concurrent.futures.wait(
                    compiling, _GRAMMAR_IDLE_WAIT_S, concurrent.futures.FIRST_COMPLETED
                )
        self._stats.num_steps_total += 1
        self._stats.num_preemptions_total += sched.num_preempted
        # Aborted or errored groups surface here even if nothing was scheduled for them.
        for group in self.groups.values():
            if any(s.request.is_finished and not s.reported_finish for s in group.samples):
                touched[group.request_id] = group
        outputs = [self._make_output(g) for g in touched.values()]
        self._stat_logger.maybe_log(self.get_stats())
        return outputs

    def _stop_string(self, req: Request, token: int) -> str | None:
        """Feed the new token to the request's detokenizer; the stop string it completes.

        As in vLLM, a stop token ends the text without appearing in it, so such a token is not
        detokenized (unless `include_stop_str_in_output`).
        """
        _, sample = self._by_request[req.request_id]
        params = req.sampling_params
        hides_token = (
            token in params.stop_token_ids
            and req.num_output_tokens >= params.min_tokens
            and not params.include_stop_str_in_output
        )
        if sample.detokenizer is None or hides_token:
            return None
        return sample.detokenizer.add_token(token)

    def _route_samples(
        self, sampled: list[Request], result: ModelRunnerOutput, touched: dict[str, _RequestGroup]
    ) -> None:
        """Hand each new token (and its logprobs) to the output of the request it belongs to."""
        now = time.monotonic()
        lp = result.logprobs
        lp_ids = lp.token_ids.tolist() if lp is not None else None
        lp_vals = lp.logprobs.tolist() if lp is not None else None
        lp_ranks = lp.ranks.tolist() if lp is not None else None
        for row, (req, token) in enumerate(zip(sampled, result.sampled_token_ids, strict=True)):
            group, sample = self._by_request[req.request_id]
            touched[group.request_id] = group
            if group.first_token_time is None:
                group.first_token_time = now
            sample.new_token_ids.append(token)
            self._stats.generation_tokens_total += 1
            num_logprobs = req.sampling_params.logprobs
            if num_logprobs is not None and lp_ids is not None:
                entry = self._logprob_entry(token, num_logprobs, lp_ids[row], lp_vals[row])
                entry[token].rank = lp_ranks[row]
                sample.new_logprobs.append(entry)
                sample.cumulative_logprob += lp_vals[row][0]

    def _logprob_entry(
        self, token: int, num: int, ids: list[int], values: list[float]
    ) -> dict[int, Logprob]:
        """The sampled token (column 0) plus the top-`num` tokens, decoded when possible."""
        entry = {token: Logprob(values[0])}
        for j in range(1, num + 1):
            entry.setdefault(ids[j], Logprob(values[j], j))
        if self.tokenizer is not None:
            for tid, value in entry.items():
                value.decoded_token = self.tokenizer.decode([tid])
        return entry

    def _make_output(self, group: _RequestGroup) -> RequestOutput:
        completions = []
        for sample in group.samples:
            req = sample.request
            finished_now = req.is_finished and not sample.reported_finish
            if not sample.new_token_ids and not finished_now:
                continue
            text = sample.detokenizer.take_new_text(req.is_finished) if sample.detokenizer else ""
            want_lp = req.sampling_params.logprobs is not None
            completions.append(
                CompletionOutput(
                    index=sample.index,
                    text=text,
                    token_ids=sample.new_token_ids,
                    cumulative_logprob=sample.cumulative_logprob if want_lp else None,
                    logprobs=sample.new_logprobs if want_lp else None,
                    finish_reason=req.status.finish_reason,
                    stop_reason=req.stop_reason,
                )
            )
            sample.new_token_ids = []
            sample.new_logprobs = []
            if req.is_finished:
                sample.reported_finish = True
        finished = group.finished
        out = RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=max(0, group.samples[0].request.num_cached_tokens),
            error=group.error
            or next((s.request.error for s in group.samples if s.request.error), None),
        )
        if group.first_token_time is not None:
            out.metrics["time_to_first_token"] = group.first_token_time - group.arrival_time
        if finished:
            out.metrics["e2e_latency"] = time.monotonic() - group.arrival_time
            for sample in group.samples:
                reason = sample.request.status.finish_reason or "unknown"
                self._stats.finished_reasons[reason] = (
                    self._stats.finished_reasons.get(reason, 0) + 1
                )
                self._by_request.pop(sample.request.request_id, None)
            del self.groups[group.request_id]
        return out

    # ---- observability ------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        s = self._stats
        bm = self.block_manager
        s.num_running = self.scheduler.num_running
        s.num_waiting = self.scheduler.num_waiting
        s.kv_cache_usage = bm.usage
        s.num_free_blocks = bm.get_num_free_blocks()
        s.prefix_cache_queries = bm.prefix_cache_queries
        s.prefix_cache_hits = bm.prefix_cache_hits
        s.num_ubatched_steps_total = self.runner.num_ubatched_steps
        return s

    def get_tokenizer(self) -> Any:
        return self.tokenizer
