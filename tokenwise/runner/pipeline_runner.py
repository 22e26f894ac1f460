"""The model runner of one pipeline stage, with one virtual engine per micro-batch in flight.

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
from tokenwise.distributed.step_message import decode_step, encode_step, step_inputs
from tokenwise.distributed.tp_channel import TPDriver
from tokenwise.engine.step_outputs import ModelRunnerOutput, SchedulerOutput
from tokenwise.forward_context import set_forward_context
from tokenwise.layers.pipeline import IntermediateTensors
from tokenwise.runner.input_batch import InputBatch, StepInputs
from tokenwise.runner.kind_part import RunnerKindPart
from tokenwise.runner.model_runner import ModelRunner
from tokenwise.runner.prompt_logprobs import (
    PromptLogprobRows,
    plan_prompt_logprobs,
    score_prompt_tokens,
)
from tokenwise.runner.sample_step import sample_step


@dataclass
class _InFlight:
    """A micro-batch the driver submitted and has not collected yet."""

    virtual_engine: int
    step: StepInputs
    num_sample_rows: int
    prompt_rows: PromptLogprobRows | None


class PipelineModelRunner(ModelRunner):
    def __init__(
        self,
        config: EngineConfig,
        device: str | torch.device,
        tp: TPDriver,
        channel: PipelineChannel,
        kind_part: type[RunnerKindPart] = RunnerKindPart,
    ) -> None:
        """`channel` is the link to the neighbouring stages, which this rank's worker joined
        (`tokenwise/executor/`)."""
        self.channel = channel
        super().__init__(config, device, tp, kind_part)
        self._check_layer_ranges()
        self.pp_rank, self.pp_size = get_pp_rank(), get_pp_size()
        batch = self.input_batch
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
        self._in_flight: deque[_InFlight] = deque()
        self._busy_s = 0.0
        # Every stage's busy seconds as of the last batch collected (driver).
        self._stage_busy = [0.0] * self.pp_size

    def _check_layer_ranges(self) -> None:
        """Every process read the partition itself (torchrun: on its own machine); refuse
        stages whose layer ranges do not follow each other (collective, at start-up)."""
        model = self.model.model
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

    # ---- KV cache: one slice per virtual engine ---------------------------------------------

    def determine_num_blocks(self) -> int:
        """Blocks of each virtual engine's slice: the pool (`num_gpu_blocks`, or what the
        memory budget holds for this stage's layers) split over the P virtual engines, the
        smallest over the stages (collective: every stage calls it once, in the same order)."""
        per_engine = torch.tensor([super().determine_num_blocks() // self.pp_size])
        self._wait_for_stages(
            dist.all_reduce(
                per_engine, op=dist.ReduceOp.MIN, group=get_pp_idle_group(), async_op=True
            ),
            "agreeing on the KV cache size",
        )
        num_blocks = int(per_engine.item())
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache holds fewer blocks than pipeline_parallel_size={self.pp_size} "
                "virtual engines; raise num_gpu_blocks or kv_cache_memory"
            )
        return num_blocks

    def _bind_kv_cache(self, num_blocks: int) -> None:
        """Each cache layer gets P tensors of `num_blocks` blocks: `kv_cache[k]` for virtual
        engine k. `kv_caches` keeps virtual engine 0's; `ve_kv_caches[k]` all of k's."""
        self.ve_kv_caches: list[dict[str, torch.Tensor]] = [{} for _ in range(self.pp_size)]
        for name, layer in self.cache_layers().items():
            shape = layer.kv_cache_shape(num_blocks, self.block_size)
            caches = [
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
                for _ in range(self.pp_size)
            ]
            for ve, cache in enumerate(caches):
                self.ve_kv_caches[ve][name] = cache
            self.kv_caches[name] = caches[0]
            layer.kv_cache = caches

    # ---- the driver: submit, then collect ---------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @torch.inference_mode()
    def submit(self, sched: SchedulerOutput, virtual_engine: int) -> None:
        """Run stage 0 of virtual engine `virtual_engine`'s batch and send it on (no wait)."""
        self.channel.check_stages()
        self.input_batch = self._input_batches[virtual_engine]
        step, _ = self._prepare(sched, self.input_batch)
        num_sample_rows = len(step.logits_indices)
        prompt_rows = plan_prompt_logprobs(step)
        if prompt_rows is not None:  # after the sampling rows; the last stage computes them
            step.logits_indices = step.logits_indices + prompt_rows.flat_indices
        tables = self.step_metadata.tables(self.input_batch, step)
        payload = encode_step(step, tables)  # bytes: owned, whatever the buffers do next
        with self.channel.failures_named():
            if self.tp.active:  # stage 0's other TP ranks run the same batch
                self.tp.broadcast(("pp_step", virtual_engine, payload))
            out = self._run_stage(
                step, self.step_metadata.build(step, tables), virtual_engine, None
            )
            self.channel.send_step(virtual_engine, payload, out, [self._busy_s])
        self._in_flight.append(_InFlight(virtual_engine, step, num_sample_rows, prompt_rows))

    @torch.inference_mode()
    def collect(self) -> tuple[int, ModelRunnerOutput]:
        """The oldest batch in flight, finished: (its virtual engine, its sampled output)."""
        batch = self._in_flight.popleft()
        step = batch.step
        if not step.logits_indices:  # a prompt chunk that samples nothing: no logits come
            return batch.virtual_engine, ModelRunnerOutput([], [], None, step.num_tokens)
        with self.channel.failures_named():
            logits, self._stage_busy = self.channel.recv_logits()
        logits = logits.to(self.device)
        self._stage_busy[0] = self._busy_s
        prompt_lps = None
        if batch.prompt_rows is not None:
            prompt_lps = score_prompt_tokens(batch.prompt_rows, logits[batch.num_sample_rows :])
        sampled = step.sampled
        token_ids: list[list[int]] = []
        logprobs = None
        if sampled:
            states = step.sampled_states
            token_ids, logprobs = sample_step(
                self.sampler,
                logits[: batch.num_sample_rows],
                sampled,
                states,
                self.model_config.vocab_size,
                self.device,
            )
            self.requests.record(states, token_ids)
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
    ) -> Any:
        started = time.perf_counter()
        with set_forward_context(
            attn_metadata, self.config, virtual_engine=virtual_engine, num_tokens=step.num_tokens
        ):
            out = self.model(step.input_ids, step.positions, intermediate_tensors=intermediate)
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
    def serve_pipeline_steps(self) -> None:
        """A stage's loop (every process but the driver): run each micro-batch it receives
        under its virtual engine and send it on, until told to stop (which it passes on)."""
        channel = self.channel
        while True:
            message = self._next_batch()
            if message is None:
                channel.forward_stop()
                return
            virtual_engine, payload, received, busy = message
            step, tables = step_inputs(decode_step(payload), self.device)
            intermediate = None if received is None else received.to(self.device)
            metadata = self.step_metadata.build(step, tables)
            out = self._run_stage(step, metadata, virtual_engine, intermediate)
            busy = [*busy, self._busy_s]
            if not channel.is_last:
                channel.send_step(virtual_engine, payload, out, busy)
            elif step.logits_indices:
                started = time.perf_counter()
                logits = self._logits(out, step.logits_indices)
                self._busy_s += time.perf_counter() - started
                channel.send_logits(logits, [*busy[:-1], self._busy_s])

    def execute_dummy_batch(self, num_tokens: int = 1) -> None:
        raise RuntimeError("pipeline parallelism runs no dummy batches (it refuses DP)")
