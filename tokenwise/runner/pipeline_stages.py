"""Pipeline parallelism's part of the runner: one stage, one virtual engine per micro-batch
in flight.

`PipelineStages` is a part the runner holds (`runner.pipeline`), not a subclass of it: the
runner's step (its kind's inputs included: a vision-language model's images and an
encoder-decoder model's encoders enter at the first stage) is laid out and its metadata built as for one process; this part decides which virtual
engine's batch it uses, sends the activations on and receives the logits.

Every stage holds its layers only (`pp_state.pp_layer_range`) and, for each attention layer,
one KV cache per virtual engine: `layer.kv_cache[k]` is virtual engine k's slice, which the
attention op picks with `ForwardContext.virtual_engine` (docs/forward-context.md §1). Virtual
engine k is the k-th
of `pipeline_parallel_size` batches in flight; each has its own scheduler and block pool in the
engine (`engine/virtual_engines.py`) and its own input batch here, because its requests, block
tables and step buffers are its own.

The driver (stage 0, the engine's runner) splits a step in two: `submit(sched, k)` prepares the
batch, runs stage 0's layers and sends the activations on without waiting; `collect()` receives
the oldest batch's logits from the last stage and samples them. Between the two the driver may
submit the next virtual engine's batch, so stage 0 computes batch k + 1 while stage 1 computes
batch k. Every other stage runs `serve_pipeline_steps`: receive, run its layers under the same
virtual engine, send on (or, the last stage, compute the sampled rows' logits and send them
back). Each stage counts the seconds it spends computing (`stage_busy_seconds`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tokenwise.attention.backends.image_mask import put_image_spans
from tokenwise.attention.metadata import AttentionMetadata
from tokenwise.config import EngineConfig
from tokenwise.distributed.pp_channel import PipelineChannel, StageMessage
from tokenwise.distributed.pp_state import (
    ENV_LAYER_PARTITION,
    get_pp_idle_group,
    get_pp_rank,
    get_pp_size,
)
from tokenwise.distributed.rendezvous import wait_polled
from tokenwise.distributed.step_message import StatePlan, decode_step, encode_step, step_inputs
from tokenwise.engine.step_outputs import ModelRunnerOutput, SchedulerOutput
from tokenwise.forward_context import set_forward_context
from tokenwise.layers.pipeline import IntermediateTensors
from tokenwise.runner.cross_metadata import apply_cross_step, cross_step
from tokenwise.runner.input_batch import InputBatch, StepInputs
from tokenwise.runner.prompt_logprobs import (
    PromptLogprobRows,
    plan_prompt_logprobs,
    score_prompt_tokens,
)
from tokenwise.runner.sample_step import sample_step

NO_LIMIT = 1 << 62


@dataclass
class _InFlight:
    """A micro-batch the driver submitted and has not collected yet."""

    virtual_engine: int
    step: StepInputs
    num_sample_rows: int
    prompt_rows: PromptLogprobRows | None


class PipelineStages:
    def __init__(self, runner: Any, channel: PipelineChannel) -> None:
        """`channel` is the link to the neighbouring stages, which this rank's worker joined
        (`tokenwise/executor/`); `runner` the model runner this part belongs to (its cache
        has one copy per virtual engine)."""
        self.runner = runner
        self.channel = channel
        self.config: EngineConfig = runner.config
        self.device = runner.device
        self.tp = runner.tp
        self.recurrent = runner.recurrent
        # A pooling model's last stage sends its hidden states back (the driver pools them)
        # instead of logits.
        self.pooling = bool(self.config.model.is_pooling)
        self._check_layer_ranges()
        self.pp_rank, self.pp_size = get_pp_rank(), get_pp_size()
        batch = runner.input_batch
        self._input_batches = [batch] + [
            InputBatch(
                batch.max_num_reqs,
                batch.max_num_tokens,
                batch.max_model_len,
                batch.block_size,
                self.device,
                num_groups=batch.num_self_groups,
            )
            for _ in range(self.pp_size - 1)
        ]
        # Each virtual engine's batch mirrors the groups the runner's parts added (recurrent
        # state, cross-attention), as wide.
        for table in batch.group_tables[batch.num_self_groups :]:
            for extra in self._input_batches[1:]:
                extra.add_kv_cache_group(table.shape[1])
        self._in_flight: deque[_InFlight] = deque()
        self._busy_s = 0.0
        # Every stage's busy seconds as of the last batch collected (driver).
        self._stage_busy = [0.0] * self.pp_size

    def _check_layer_ranges(self) -> None:
        """Every process read the partition itself (torchrun: on its own machine); refuse
        stages whose layer ranges do not follow each other (collective, at start-up)."""
        model = self.runner.model.model
        mine = torch.tensor([get_pp_rank(), model.start_layer, model.end_layer])
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        self._wait_for_stages(
            dist.all_gather(parts, mine, group=get_pp_idle_group(), async_op=True),
            "comparing the stages' layer ranges",
        )
        ranges = [tuple(int(v) for v in part.tolist()) for part in parts]
        ends = {stage: end for stage, _, end in ranges}
        for stage, start, end in ranges:
            if start != (ends[stage - 1] if stage else 0) or (
                stage == get_pp_size() - 1 and end != len(model.layers)
            ):
                raise ValueError(
                    f"the stages' layer ranges (stage, start, end) {sorted(set(ranges))} do not "
                    f"cover the layers in order: set the same {ENV_LAYER_PARTITION} everywhere"
                )

    def _wait_for_stages(self, work: Any, what: str) -> None:
        """A start-up collective over every stage: the driver checks its stages while they
        build theirs (as long as it takes while they live; a dead one is named at once)."""
        wait_polled(work, self.channel.workers if self.channel.is_driver else None, what)

    # ---- KV cache: one copy per virtual engine (`kv_sizer.copies`) --------------------------

    def agree_on_num_blocks(self, pool_blocks: int) -> int:
        """Blocks of each virtual engine's slice: the pool (`num_gpu_blocks`, or what the
        memory budget holds for this stage's layers) split over the P virtual engines, the
        smallest over the stages (collective: every stage calls it once, in the same order)."""
        sizer = self.runner.kv_sizer
        per_engine = pool_blocks // self.pp_size
        # Recurrent-state slots too: the driver's block managers hand out what every stage
        # holding state layers has (a stage without any says "no limit").
        slots = sizer.num_state_slots if self.recurrent is not None else NO_LIMIT
        agreed = torch.tensor([per_engine, slots, int(self.recurrent is not None)])
        every = [torch.empty_like(agreed) for _ in range(dist.get_world_size())]
        self._wait_for_stages(
            dist.all_gather(every, agreed, group=get_pp_idle_group(), async_op=True),
            "agreeing on the KV cache size",
        )
        num_blocks = min(int(t[0]) for t in every)
        with_state = {int(t[2]) for t in every}
        if len(with_state) > 1:
            raise ValueError(
                "some pipeline stages hold recurrent-state layers and others none: every "
                f"stage must hold some (set {ENV_LAYER_PARTITION} accordingly)"
            )
        if self.recurrent is not None:
            sizer.num_state_slots = min(int(t[1]) for t in every)
        if num_blocks < 1 and self.runner.kv_sizer.needs_kv_cache:
            raise ValueError(
                f"the KV cache holds fewer blocks than pipeline_parallel_size={self.pp_size} "
                "virtual engines; raise num_gpu_blocks or kv_cache_memory"
            )
        return num_blocks

    # ---- the driver: submit, then collect ---------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @torch.inference_mode()
    def submit(self, sched: SchedulerOutput, virtual_engine: int) -> None:
        """Run stage 0 of virtual engine `virtual_engine`'s batch and send it on (no wait)."""
        self.channel.check_stages()
        r = self.runner
        r.kind_part.begin_step(sched)
        # This virtual engine's batch (its rows and block tables) lays out the step.
        batch = r.input_batch = self._input_batches[virtual_engine]
        step, _ = r._prepare(sched, batch)
        num_sample_rows = len(step.logits_indices)
        prompt_rows = plan_prompt_logprobs(step)
        if prompt_rows is not None:  # after the sampling rows; the last stage computes them
            step.logits_indices = step.logits_indices + prompt_rows.flat_indices
        tables = r.step_metadata.tables(batch, step)
        plan = None
        if self.recurrent is not None:
            plan = self.recurrent.plan(step, batch)
        metadata = r.step_metadata.build(step, tables)
        # The kind's inputs (a vision-language model's images) enter at the first stage; its
        # 3-D positions (M-RoPE) go to every stage with the step.
        model_kwargs = r.kind_part.model_inputs(step, metadata)
        mrope = model_kwargs.get("mrope_positions")
        # Gemma 4 sets them on its sliding layers' groups only: any group that has them.
        spans = next(
            (md.bidirectional_spans for md in (metadata or {}).values() if md.bidirectional_spans),
            None,
        )
        payload = encode_step(  # bytes: owned, whatever the buffers do next
            step,
            tables,
            states=plan,
            mrope_positions=mrope,
            image_spans=spans,
            cross=cross_step(metadata),
        )
        with self.channel.failures_named():
            if self.tp.active:  # stage 0's other TP ranks run the same batch
                self.tp.broadcast(("pp_step", virtual_engine, payload))
            out = self._run_stage(step, metadata, virtual_engine, None, model_kwargs, plan)
            self.channel.send_step(virtual_engine, payload, out, [self._busy_s])
        self._in_flight.append(_InFlight(virtual_engine, step, num_sample_rows, prompt_rows))

    @torch.inference_mode()
    def collect(self) -> tuple[int, ModelRunnerOutput]:
        """The oldest batch in flight, finished: (its virtual engine, its sampled output)."""
        batch = self._in_flight.popleft()
        step = batch.step
        if not step.logits_indices and not self.pooling:  # a chunk that samples nothing
            return batch.virtual_engine, ModelRunnerOutput([], [], None, step.num_tokens)
        with self.channel.failures_named():
            logits, self._stage_busy = self.channel.recv_logits()
        logits = logits.to(self.device)
        self._stage_busy[0] = self._busy_s
        if self.pooling:  # the last stage's hidden states: pooled here
            hidden = logits.to(self.runner.model_config.dtype)
            return batch.virtual_engine, self.runner.kind_part.finish_step(step, hidden)
        prompt_lps = None
        if batch.prompt_rows is not None:
            prompt_lps = score_prompt_tokens(batch.prompt_rows, logits[batch.num_sample_rows :])
        sampled = step.sampled
        token_ids: list[list[int]] = []
        logprobs = None
        if sampled:
            states = step.sampled_states
            r = self.runner
            token_ids, logprobs = sample_step(
                r.sampler,
                logits[: batch.num_sample_rows],
                sampled,
                states,
                r.model_config.vocab_size,
                self.device,
            )
            r.requests.record(states, token_ids)
        output = ModelRunnerOutput(
            sampled, token_ids, logprobs, step.num_tokens, prompt_logprobs=prompt_lps
        )
        return batch.virtual_engine, output

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One batch through the whole pipeline on virtual engine 0, nothing overlapped."""
        if self._in_flight:
            raise RuntimeError("execute_model with micro-batches in flight: collect them first")
        self.submit(scheduler_output, 0)
        return self.collect()[1]

    def stage_busy_seconds(self) -> list[float]:
        """Seconds each stage has spent computing, as of the last batch that sampled (the
        later stages report theirs with their logits)."""
        return list(self._stage_busy)

    # ---- every stage ------------------------------------------------------------------------

    def _run_stage(
        self,
        step: StepInputs,
        attn_metadata: dict[str, AttentionMetadata],
        virtual_engine: int,
        intermediate: IntermediateTensors | None,
        model_kwargs: dict[str, Any] | None = None,
        plan: StatePlan | None = None,
    ) -> Any:
        """This stage's layers over one micro-batch of `virtual_engine` (with its recurrent
        states' copies before and after, when `plan` has any)."""
        started = time.perf_counter()
        if plan is not None and self.recurrent is not None:
            attn_metadata.update(self.recurrent.begin(plan, virtual_engine))
        with set_forward_context(
            attn_metadata, self.config, virtual_engine=virtual_engine, num_tokens=step.num_tokens
        ):
            model = self.runner.kind_part.forward_model(model_kwargs)
            out = model(
                step.input_ids,
                step.positions,
                intermediate_tensors=intermediate,
                **(model_kwargs or {}),
            )
        if plan is not None and self.recurrent is not None:
            self.recurrent.finish(plan, virtual_engine)
        self._busy_s += time.perf_counter() - started
        return out

    def _next_batch(self) -> StageMessage | None:
        """The next micro-batch: from the previous stage, or (stage 0's other TP ranks) from
        the driver's TP broadcast, which carries no activations. None: stop."""
        if not self.channel.is_first:
            return self.channel.recv_step()
        message = self.tp.receive()
        if message[0] == "stop":
            return None
        _, virtual_engine, payload = message
        return virtual_engine, payload, None, [self._busy_s]

    @torch.inference_mode()
    def serve(self) -> None:
        """A stage's loop (every process but the driver): run each micro-batch it receives
        under its virtual engine and send it on, until told to stop (which it passes on)."""
        channel = self.channel
        while True:
            message = self._next_batch()
            if message is None:
                channel.forward_stop()
                return
            virtual_engine, payload, received, busy = message
            step_message = decode_step(payload)
            step, tables = step_inputs(step_message, self.device)
            intermediate = None if received is None else received.to(self.device)
            metadata = self.runner.step_metadata.build(step, tables)
            if step_message.image_spans is not None:  # as the first stage's kind set them
                layers = getattr(self.runner.model, "bidirectional_image_layers", None)
                put_image_spans(metadata, step_message.image_spans, layers)
            if step_message.cross is not None:  # an encoder-decoder model's cross rows
                apply_cross_step(step_message.cross, metadata, self.runner.attn_layers, self.device)
            kwargs = {}
            if step_message.mrope_positions is not None:
                kwargs["mrope_positions"] = step_message.mrope_positions.tensor(self.device)
            out = self._run_stage(
                step, metadata, virtual_engine, intermediate, kwargs, step_message.states
            )
            busy = [*busy, self._busy_s]
            if not channel.is_last:
                channel.send_step(virtual_engine, payload, out, busy)
            elif self.pooling:
                channel.send_logits(out, [*busy[:-1], self._busy_s])
            elif step.logits_indices:
                started = time.perf_counter()
                logits = self.runner._logits(out, step.logits_indices)
                self._busy_s += time.perf_counter() - started
                channel.send_logits(logits, [*busy[:-1], self._busy_s])
