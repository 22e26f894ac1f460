"""Continuous-batching scheduler: which requests run this step, and how many tokens each.

Each step has a token budget (`max_num_batched_tokens`) and a request limit (`max_num_seqs`).
Running requests are served first, in admission order (decodes take one token, unfinished
prompts take the next chunk); then waiting requests are admitted in arrival order while budget
and KV blocks remain. A prompt longer than the remaining budget is chunked across steps, so one
forward pass mixes prefills and decodes and long prompts never stall running decodes.

A request asking for prompt logprobs is admitted without prefix-cache hits: the runner scores
its prompt from the hidden states of every prompt position, which cached blocks do not keep.

When a running request needs a block and none is free, the most recently admitted running
request is preempted: its blocks are freed and it goes back to the head of the waiting queue,
to be recomputed later (its output so far is kept).

That is the "fcfs" policy. Under "priority" (`request_queue`) the queue is ordered by
`(priority, arrival)`, the victim is the running request with the worst such key (taken back
out of this step if already scheduled), and a waiting request that does not fit preempts
running requests of strictly worse priority.

A guided-decoding request waits until its grammar has compiled (on another thread, see
`tokenwise.sampling.guided.compiler`): waiting requests whose grammar is not ready are passed
over, keeping their place, and one whose compile failed or timed out ends with an error.

No livelock, by construction: a step that schedules nothing while nothing runs and requests
wait means the head of the queue cannot be placed even with the whole pool and the whole token
budget to itself, and its needs only grow. It is aborted (reported in `SchedulerOutput.aborted`
with the reason) instead of being retried forever, and the queue moves on.

The scheduler is the one writer of request state: it places requests (admission, preemption;
the block manager it drives owns their block tables) and, in `update_from_output`, applies what
the forward pass did to them (computed tokens, sampled tokens, then the stop rules of
`stop_rules`, freeing finished requests). The runner only reads requests and the block deltas
each `ScheduledRequest` carries; the engine detokenizes and routes outputs to callers, handing
the scheduler the stop strings its detokenizers found: nothing here calls back into it.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future

from tokenwise.config import SchedulerConfig
from tokenwise.engine.block_manager import CROSS_ATTN, BlockManager, KVCacheBlocks
from tokenwise.engine.grammar_waits import GrammarWaits
from tokenwise.engine.kv_tier_waits import KVTierWaits
from tokenwise.engine.request import Request, RequestStatus
from tokenwise.engine.request_queue import create_request_queue
from tokenwise.engine.scheduler_hooks import KindHooks
from tokenwise.engine.step_apply import OnToken, apply_forward_pass, drafts_to_verify
from tokenwise.engine.step_outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput

__all__ = ["Scheduler", "ScheduledRequest", "SchedulerOutput"]


class Scheduler(KindHooks, KVTierWaits, GrammarWaits):
    """The decoder-only scheduler; a model kind changes it through `KindHooks`."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        max_loras: int | None = None,
    ) -> None:
        self.config = config
        # LoRA: at most this many distinct adapters among the running requests, so every step
        # fits the runner's adapter slots (None: LoRA off).
        self.max_loras = max_loras
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._left_since_last_step: list[str] = []
        self._preempted_since_last_step: list[str] = []
        self._sent_to_runner: set[str] = set()  # requests the runner keeps state for

    def add_request(self, request: Request) -> None:
        """Queue a request; one that can never fit is rejected here, not left waiting forever."""
        n = request.num_tokens
        if n > self.max_model_len:
            raise ValueError(f"prompt has {n} tokens, more than max_model_len={self.max_model_len}")
        blocks_needed = self.block_manager.max_blocks_per_request(
            min(self.max_model_len, n + 1), self.config.max_num_batched_tokens
        )
        blocks_needed += self.admission_blocks(request)
        if blocks_needed > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt of {n} tokens needs {blocks_needed} KV blocks but the cache has only "
                f"{self.block_manager.num_blocks}; raise kv_cache_memory or shorten the prompt"
            )
        if not self.config.enable_chunked_prefill and n > self.config.max_num_batched_tokens:
            raise ValueError(
                f"prompt has {n} tokens, more than max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens} with chunked prefill disabled"
            )
        request.status = RequestStatus.WAITING
        self.waiting.add_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        bm.discard_step()  # a step scheduled but never applied (a failed forward pass)
        self.poll_tier_loads()

        # 1. Running requests, oldest first: decodes and continuing prompt chunks.
        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            known = req.num_tokens + req.num_output_placeholders  # in flight (async) too
            num_new = min(known - req.num_computed_tokens, budget)
            num_new = self.limit_chunk(req, req.num_computed_tokens, num_new)
            num_new = self._align_chunk(req, req.num_computed_tokens, num_new)
            if num_new <= 0:
                idx += 1
                continue
            spec = drafts_to_verify(req, num_new, budget, self.max_model_len)
            num_new += len(spec)
            while True:
                new_blocks = bm.allocate_slots(
                    req.request_id,
                    req.all_token_ids,
                    req.num_computed_tokens,
                    num_new,
                    cache_salt=req.cache_salt,
                    images=self.image_spans(req),
                )
                if new_blocks is not None:
                    out.scheduled.append(self._scheduled(req, num_new, new_blocks, spec=spec))
                    budget -= num_new
                    idx += 1
                    break
                victim_idx = self.waiting.victim_index(self.running)
                victim = self.running.pop(victim_idx)
                if victim_idx < idx:  # scheduled earlier in this step: take it back out
                    idx -= 1
                    budget += out.unschedule(victim)
                self._preempt(victim)
                out.num_preempted += 1
                if victim is req:
                    break

        # 2. Waiting requests in arrival order, unless this step already had to preempt.
        adapters: set[int] = set()
        if self.max_loras is not None:  # LoRA on: the adapters the running requests hold
            adapters = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        self.poll_grammars()
        not_ready: list[Request] = []  # guided requests still compiling keep their place
        preempted_running = out.num_preempted > 0
        while self.waiting and budget > 0 and not preempted_running:
            req = self.waiting.peek_request()
            if req.grammar is not None and not req.grammar.ready:
                not_ready.append(self.waiting.pop_request())
                continue
            if self.still_loading(req):  # its prefix is being read back from the KV tier
                not_ready.append(self.waiting.pop_request())
                continue
            if len(self.running) >= self.config.max_num_seqs:
                # Under "priority" a more urgent request takes a less urgent one's slot.
                restored = self._preempt_for(req, out)
                if restored is None:
                    break
                budget += restored
                continue
            lora = req.lora_request
            if (
                lora is not None
                and self.max_loras is not None
                and lora.lora_int_id not in adapters
                and len(adapters) >= self.max_loras
            ):
                break  # its adapter needs a slot: it waits until a running adapter is done
            # Tokens a kind runs at admission (an encoder's input) share the step's budget.
            num_encoder = self.admission_tokens(req)
            if num_encoder and num_encoder + 1 > budget:
                break
            hits = None
            num_hit = 0
            # Prompt logprobs need the hidden state of every prompt position, which a cached
            # block does not keep: such a request computes its whole prompt itself (as in vLLM).
            if req.sampling_params.prompt_logprobs is None:
                hits, num_hit = bm.get_computed_blocks(
                    req.request_id, req.all_token_ids, req.cache_salt, self.image_spans(req)
                )
                if self.start_tier_load(req):
                    not_ready.append(self.waiting.pop_request())
                    continue
            num_new = req.num_tokens - num_hit
            if num_new > budget - num_encoder:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget - num_encoder
            num_new = self.limit_chunk(req, num_hit, num_new)
            num_new = self._align_chunk(req, num_hit, num_new)
            if num_new <= 0:
                break  # its next chunk fits a later step's budget (limit_chunk)
            new_blocks = bm.allocate_slots(
                req.request_id,
                req.all_token_ids,
                0,
                num_new,
                hits,
                cache_salt=req.cache_salt,
                images=self.image_spans(req),
            )
            extra_blocks = None
            if new_blocks is not None:
                # After the self-attention blocks: those took its prefix-cache hits out of the
                # free queue, so these fresh blocks cannot evict them.
                extra_blocks = self.allocate_admission_blocks(req)
                if extra_blocks is None:
                    # Its newly registered blocks were never computed: drop them from the cache.
                    bm.free(req.request_id, discard_cached=True)
            if new_blocks is None or extra_blocks is None:
                self.drop_chunk(req)
                restored = self._preempt_for(req, out)  # "priority": make room, then retry
                if restored is None:
                    break
                budget += restored
                continue
            self.waiting.pop_request()
            self.end_tier_wait(req)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if lora is not None:
                adapters.add(lora.lora_int_id)
            out.scheduled.append(
                self._scheduled(req, num_new, new_blocks, extra_blocks, num_encoder)
            )
            budget -= num_new + num_encoder
        self.waiting.prepend_requests(not_ready)

        # 3. Nothing scheduled, nothing running, yet requests wait: the head can never run
        # (requests whose grammar is still compiling are not stuck, just not ready).
        if out.is_empty and not self.running:
            req = next((r for r in self.waiting if self.placeable_now(r)), None)
            if req is not None and not self.release_tier_loads():
                reason = self._unplaceable_reason(req)
                self.finish_requests([req], RequestStatus.FINISHED_ABORTED)
                out.aborted.append((req, reason))
        if not out.is_empty:  # an empty step reaches no runner: keep the ids for the next
            out.finished_req_ids, self._left_since_last_step = self._left_since_last_step, []
            out.preempted_req_ids = self._preempted_since_last_step
            self._preempted_since_last_step = []
            out.send_new_requests(self._sent_to_runner)
        return out

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        on_token: OnToken | None = None,
    ) -> list[tuple[Request, int]]:
        """Apply one forward pass: computed tokens, sampled tokens, stops; free what finished.

        Returns each request that received tokens with how many of its emitted tokens it kept,
        in the runner's sampling order (a stop ends a request at the token that completed it,
        so drafts accepted after that token are dropped). `on_token(req, token)` is called
        before each token is appended (the engine's detokenizer) and returns the stop string
        the token completed, if any; every stop rule (`stop_rules.check_stop`) is then applied
        here, once per token.

        Rejected drafts roll back here (`step_apply.apply_forward_pass`).
        """
        self.block_manager.commit_step()  # the step ran: its state snapshots are written
        sampled, finished = apply_forward_pass(
            scheduler_output, runner_output, on_token, self.max_model_len
        )
        for status, reqs in finished.items():
            self.finish_requests(reqs, status)
        return sampled

    def _scheduled(
        self,
        req: Request,
        num_new: int,
        new_blocks: KVCacheBlocks,
        admitted_blocks: list[int] | None = None,
        num_admission_tokens: int = 0,
        spec: list[int] | None = None,
    ) -> ScheduledRequest:
        """The step's entry for `req`, with the block deltas the runner's mirror needs.

        The request's own groups grow step by step (`new_blocks`, one list per group); a
        kind's admission group (cross-attention) is allocated whole at admission
        (`admitted_blocks`) and unchanged after.
        """
        bm = self.block_manager
        rid = req.request_id
        spec = spec or []
        if len(new_blocks) == 1:  # every step of every request: no generators here
            return ScheduledRequest(
                req, num_new, num_admission_tokens, new_blocks, (bm.num_blocks_of(rid),), spec
            )
        if admitted_blocks:
            new_blocks = new_blocks[:CROSS_ATTN] + (admitted_blocks,) + new_blocks[CROSS_ATTN + 1 :]
        counts = tuple(bm.num_blocks_of(rid, g) for g in range(len(new_blocks)))
        return ScheduledRequest(
            req,
            num_new,
            num_admission_tokens,
            new_blocks,
            counts,
            spec,
            state_step=bm.take_state_step(rid),
        )

    def _align_chunk(self, req: Request, num_computed: int, num_new: int) -> int:
        """A prompt chunk ends on a block boundary when the model keeps recurrent state and
        prefix caching is on (vLLM's "align" mode): states are snapshotted where a step ends,
        so a chunk that stops mid-block leaves no state for a later hit to resume from. The
        tail of a prompt past its last boundary runs as a step of its own."""
        bm = self.block_manager
        if num_new <= 1 or not bm.has_recurrent_state or not bm.enable_caching:
            return num_new
        aligned = (num_computed + num_new) // bm.block_size * bm.block_size - num_computed
        return aligned if aligned > 0 else num_new

    def waiting_grammars(self) -> list[Future]:
        """What waiting requests wait for: grammar compiles and tier loads (the engine sleeps
        on them when idle)."""
        return self.grammar_futures() + self.tier_load_futures()

    def _unplaceable_reason(self, req: Request) -> str:
        bm = self.block_manager
        tokens = max(req.num_tokens, 1)
        if not self.config.enable_chunked_prefill and tokens > self.config.max_num_batched_tokens:
            return (
                f"request needs {tokens} tokens in one step, more than max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens} with chunked prefill disabled"
            )
        blocks = bm.max_blocks_per_request(tokens, self.config.max_num_batched_tokens)
        return (
            f"request needs {blocks} KV blocks for {tokens} tokens but the whole pool has "
            f"{bm.num_blocks} blocks of {bm.block_size} tokens"
        )

    def _preempt_for(self, req: Request, out: SchedulerOutput) -> int | None:
        """Preempt the policy's victim if waiting `req` may displace it ("priority" only); the
        budget that gives back (it may be scheduled already), None if nothing was preempted."""
        if not self.running:
            return None
        victim = self.running[self.waiting.victim_index(self.running)]
        if not self.waiting.displaces(req, victim):
            return None
        self.running.remove(victim)
        restored = out.unschedule(victim)
        self._preempt(victim)
        out.num_preempted += 1
        return restored

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req.request_id)
        self._preempted_since_last_step.append(req.request_id)
        req.num_computed_tokens = 0  # its cross blocks went too: the encoder reruns on resume
        req.spec_token_ids = []
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.prepend_request(req)

    def finish_requests(
        self, requests: Iterable[Request], status: RequestStatus, discard_cached: bool = False
    ) -> None:
        """Remove finished (or aborted) requests and free their blocks at once.

        `discard_cached` drops the freed blocks from the prefix cache: after a failed forward
        pass their contents are unknown, and no later request may hit them.
        """
        done = [req for req in requests if not req.is_finished]
        for req in done:
            req.status = status
            self.block_manager.free(req.request_id, discard_cached=discard_cached)
            self.end_tier_wait(req)
            self._left_since_last_step.append(req.request_id)
            self._sent_to_runner.discard(req.request_id)
        if done:
            ids = {id(r) for r in done}
            self.running = [r for r in self.running if id(r) not in ids]
            self.waiting.remove_requests(done)
