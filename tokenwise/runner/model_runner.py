"""Turns one scheduled step into a forward pass and sampled tokens.

Input: a list of (request, number of new tokens). The runner lays the tokens out prefills first,
builds attention metadata once per attention spec, runs the model inside `set_forward_context`,
computes logits only for the rows that sample (the last token of each sequence that this step
completes), and samples them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tokenwise.attention.backends.selector import get_attn_backend
from tokenwise.attention.layer import AttentionLayerBase
from tokenwise.attention.metadata import AttentionMetadata
from tokenwise.config import CUDAGraphMode, EngineConfig
from tokenwise.distributed.dp_coordination import DPStepCounts, coordinate_step_across_dp
from tokenwise.distributed.pp_channel import PipelineChannel
from tokenwise.distributed.step_message import decode_step, encode_step, step_inputs
from tokenwise.distributed.tp_channel import TPDriver
from tokenwise.distributed.tp_state import get_tp_size
from tokenwise.engine.step_outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tokenwise.forward_context import set_forward_context
from tokenwise.layer_registry import get_layers_from_config
from tokenwise.runner import verify_rows
from tokenwise.runner.deferred_tokens import DeferredTokens, sample_or_defer
from tokenwise.runner.graph_runner import CUDAGraphRunner
from tokenwise.runner.graph_setup import default_capture_sizes, graph_rows, graph_setup
from tokenwise.runner.input_batch import InputBatch, StepInputs
from tokenwise.runner.kind_part import RunnerKindPart
from tokenwise.runner.kv_cache_sizing import KVCacheSizer, cache_layers, make_kv_cache_layout
from tokenwise.runner.model_setup import load_prepared_model
from tokenwise.runner.pipeline_stages import PipelineStages
from tokenwise.runner.prompt_logprobs import plan_prompt_logprobs, score_prompt_tokens
from tokenwise.runner.recurrent_graph import attach_recurrent_inputs
from tokenwise.runner.recurrent_states import RecurrentStates
from tokenwise.runner.request_states import RequestStates
from tokenwise.runner.step_metadata import make_step_metadata
from tokenwise.runner.target_hidden import TargetHiddenCapture
from tokenwise.runner.ubatch_runner import Trace, run_ubatches
from tokenwise.sampling.sampler import Sampler

logger = logging.getLogger(__name__)

# A step's attention metadata by layer name (None while a FULL graph replays on its own).
MetadataByLayer = dict[str, AttentionMetadata] | None


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        device: str | torch.device = "cpu",
        tp: TPDriver | None = None,
        kind_part: type[RunnerKindPart] = RunnerKindPart,
        pipeline: PipelineChannel | None = None,
    ) -> None:
        """`tp` is the channel to the other TP ranks, which this rank's worker has joined
        (`tokenwise/executor/`); None without tensor parallelism. `kind_part` is what the
        model kind adds to a step (`runner/kind_part.py`). `pipeline`: the link to the
        neighbouring pipeline stages (the runner then holds a `PipelineStages` part and one
        KV cache per virtual engine)."""
        if config.model is None:
            raise ValueError("ModelRunner needs EngineConfig.model (a ModelConfig)")
        self.config = config
        self.device = torch.device(device)
        self.model_config = config.model
        self.block_size = config.cache.block_size
        self.tp = tp if tp is not None else TPDriver(None)
        self.tp_size = get_tp_size()
        self.kind_part = kind_part(self)
        self._capturer_factory, wrap_piece = graph_setup(config, self.device)
        scheduler = config.scheduler
        compilation = config.compilation
        if self._capturer_factory is not None and compilation.cudagraph_capture_sizes is None:
            compilation.cudagraph_capture_sizes = default_capture_sizes(
                graph_rows(config), scheduler.max_num_batched_tokens, str(config.device)
            )
        max_capture = compilation.max_capture_size if self._capturer_factory else 0
        max_num_tokens = max(scheduler.max_num_batched_tokens, max_capture)
        self.model, self.lora_manager = load_prepared_model(
            config, self.device, max_num_tokens, wrap_piece
        )
        self.attn_layers = get_layers_from_config(config, AttentionLayerBase)
        if not self.attn_layers:
            raise RuntimeError("the model registered no attention layers")
        self.sampler = Sampler()
        self.requests = RequestStates()  # the runner's own copy of each request it runs
        parallel = config.parallel
        # MoE under DP: every forward pass is a collective (see tokenwise.engine.core_process).
        self.dp_lockstep = parallel.data_parallel_size > 1 and bool(parallel.is_moe_model)
        self.num_ubatched_steps = 0
        self.last_ubatch_trace: Trace = None
        # The last step's graph mode and batch descriptor (None: eager), for its step record.
        self.last_graph: tuple[CUDAGraphMode, Any] = (CUDAGraphMode.NONE, None)
        self.last_query_len = 0  # of every request in a uniform batch (0: not uniform)
        self.num_blocks = 0
        # Set by the engine when an EAGLE head proposes drafts: the target features it reads.
        self.hidden_capture: TargetHiddenCapture | None = None
        # Layers grouped by KV-cache spec; each group's layers share one metadata object.
        self.kv_cache_layout = make_kv_cache_layout(config, self.attn_layers)
        self.step_metadata, self._verify_query_len = make_step_metadata(
            config, self.kv_cache_layout, self.attn_layers, self.device
        )
        self.input_batch = InputBatch(
            max_num_reqs=max(scheduler.max_num_seqs, max_capture),
            max_num_tokens=max_num_tokens,
            max_model_len=self.model_config.max_model_len,
            block_size=self.block_size,
            device=self.device,
            num_groups=self.kv_cache_layout.num_attention_groups,
        )
        # Recurrent-state layers (their state copies around each step); CPU graphs only.
        self.recurrent = RecurrentStates.create(
            self.kv_cache_layout, self.attn_layers, self.input_batch, config, self.dp_lockstep
        )
        if self.recurrent is not None and self.device.type != "cpu":
            self._capturer_factory = None
        # Built once, here; KV sizing asks it to `measure()` and `initialize_kv_cache` to
        # `capture()`. None when the mode has no graphs.
        self.graph_runner: CUDAGraphRunner | None = None
        if self._capturer_factory is not None:
            self.graph_runner = CUDAGraphRunner(
                self.model,
                config,
                self.device,
                self._capturer_factory,
                {name: layer.sliding_window for name, layer in self.attn_layers.items()},
                get_attn_backend(config),
                self.input_batch,
                self.lora_manager.state if self.lora_manager is not None else None,
                self.kind_part.max_cross_blocks_per_seq(),
                self._verify_query_len,
                num_groups=self.kv_cache_layout.num_attention_groups,
            )
            attach_recurrent_inputs(self.graph_runner, self.recurrent)
        self.kv_sizer = KVCacheSizer(
            config,
            self.attn_layers,
            self.kv_cache_layout,
            self.device,
            self.model,
            self.tp,
            self.graph_runner,
            # A later pipeline stage of a pooling model has the base kind part: its layers
            # say it keeps no cache.
            self.kind_part.needs_kv_cache and bool(cache_layers(self.attn_layers)),
            copies=config.parallel.pipeline_parallel_size if pipeline is not None else 1,
        )
        self.kind_part.setup()
        self.pipeline = PipelineStages(self, pipeline) if pipeline is not None else None
        # Async scheduling on a GPU: sampled ids come back by a non-blocking copy.
        self.deferred = DeferredTokens.create(config, self.device, self.tp_size, self.input_batch)

    # ---- KV cache (sized and allocated by `kv_sizer`) ---------------------------------------

    def determine_num_blocks(self) -> int:
        """KV blocks for the pool, agreed over the TP ranks (a start-up collective); under
        pipeline parallelism, of each virtual engine's slice, agreed over the stages."""
        num_blocks = self.kv_sizer.determine_num_blocks()
        if self.pipeline is not None:
            num_blocks = self.pipeline.agree_on_num_blocks(num_blocks)
        return num_blocks

    def cache_layers(self) -> dict[str, AttentionLayerBase]:
        """The attention layers that keep a KV cache (encoder-only attention keeps none)."""
        return cache_layers(self.attn_layers)

    @property
    def num_state_slots(self) -> int:
        """Recurrent-state slots (0 without recurrent layers), set by `determine_num_blocks`."""
        return self.kv_sizer.num_state_slots

    @property
    def kv_caches(self) -> dict[str, torch.Tensor]:
        """Layer name -> its cache tensor (virtual engine 0's under pipeline parallelism)."""
        return self.kv_sizer.kv_caches

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, then capture CUDA graphs on it (when the mode has any)."""
        self.kv_sizer.allocate(num_blocks)
        self.num_blocks = num_blocks
        if not self.kv_sizer.needs_kv_cache:
            return
        if self.graph_runner is not None and self.device.type != "cuda":
            self.graph_runner.capture()  # CPU graphs: recorded kernel calls, no device memory
        elif self.graph_runner is not None:
            reserved = torch.cuda.memory_reserved(self.device)
            self.graph_runner.capture()
            logger.info(
                "CUDA graphs captured; PyTorch's reserved memory grew by %.2f GiB",
                (torch.cuda.memory_reserved(self.device) - reserved) / 2**30,
            )

    # ---- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: the scheduler's output is the only input."""
        if self.pipeline is not None:  # through every stage, on virtual engine 0
            return self.pipeline.execute_model(scheduler_output)
        self.kind_part.begin_step(scheduler_output)
        if self.deferred is not None:  # the sampled ids that reached the host, before reads
            self.deferred.fill(wait=False)
        step, ordered = self._prepare(scheduler_output, self.input_batch)
        if self.deferred is not None:  # the others: fed on the device
            self.deferred.patch_inputs(step)
        num_sample_rows = len(step.logits_indices)
        prompt_rows = plan_prompt_logprobs(step)
        if prompt_rows is not None:  # after the sampling rows; TP workers compute them too
            step.logits_indices = step.logits_indices + prompt_rows.flat_indices
        num_tokens = step.num_tokens
        loras = [state.lora_request for state in step.states]
        has_lora = self._prepare_lora(loras, step)
        mode, desc, query_len = CUDAGraphMode.NONE, None, 0
        if self.graph_runner is not None and self.kind_part.may_replay_graphs(step):
            step, mode, desc, query_len = verify_rows.plan_graph(
                self.graph_runner, self.input_batch, step, has_lora, self._verify_query_len
            )
        self.last_graph = (mode, desc if mode != CUDAGraphMode.NONE else None)
        self.last_query_len = query_len
        attn_metadata, tables = None, {}
        if mode != CUDAGraphMode.FULL:
            tables = self.step_metadata.tables(self.input_batch, step)
            attn_metadata = self.step_metadata.build(step, tables)
        state_plan = self.recurrent.plan(step) if self.recurrent is not None else None
        if state_plan is not None:
            recurrent_md = self.recurrent.begin(state_plan)
            if mode == CUDAGraphMode.FULL:  # the graph reads its slots from its own buffers
                self.graph_runner.recurrent.prepare(state_plan)
            else:
                attn_metadata.update(recurrent_md)
        model_kwargs = self.kind_part.model_inputs(step, attn_metadata)
        if self.deferred is not None:  # the next step rewrites the pinned input buffers
            self.deferred.inputs_queued()
        if self.tp_size > 1:
            self.tp.check_workers()
            self.tp.broadcast(("step", encode_step(step, tables, loras, state_plan)))
        capture = self.hidden_capture
        if capture is not None:
            capture.begin()
        with self.tp.failures_named():
            if mode != CUDAGraphMode.NONE:
                assert self.graph_runner is not None
                hidden = self.graph_runner.execute(mode, desc, attn_metadata, num_tokens)
            else:
                hidden = self._run_eager(step, attn_metadata, model_kwargs)
            if state_plan is not None:
                self.recurrent.finish(state_plan)
            if (kind_output := self.kind_part.finish_step(step, hidden)) is not None:
                return kind_output
            target_hidden = capture.collect(hidden, ordered) if capture is not None else None
            if not step.logits_indices:
                return ModelRunnerOutput([], [], None, num_tokens, target_hidden=target_hidden)
            logits = self._logits(hidden, step.logits_indices)
        prompt_lps = None
        if prompt_rows is not None:
            prompt_lps = score_prompt_tokens(prompt_rows, logits[num_sample_rows:])
        sampled = step.sampled
        if not sampled:
            return ModelRunnerOutput(
                [], [], None, num_tokens, prompt_logprobs=prompt_lps, target_hidden=target_hidden
            )
        states = step.sampled_states
        token_ids, logprobs, pending = sample_or_defer(
            self.deferred if capture is None else None, self.sampler,
            logits[:num_sample_rows], sampled, states, self.model_config.vocab_size, self.device,
        )  # fmt: skip
        if pending is None:
            self.requests.record(states, token_ids)
        if state_plan is not None:
            pairs = self.recurrent.restores(step, state_plan, sampled, token_ids)
            self.recurrent.restore(pairs, self.tp if self.tp_size > 1 else None)
        return ModelRunnerOutput(
            sampled,
            token_ids,
            logprobs,
            num_tokens,
            prompt_logprobs=prompt_lps,
            target_hidden=target_hidden,
            pending_token_ids=pending,
        )

    def _prepare(
        self, scheduler_output: SchedulerOutput, batch: InputBatch
    ) -> tuple[StepInputs, list[ScheduledRequest]]:
        """Take in the step's new and finished requests and lay out its inputs in `batch`:
        the step, and its entries in the order laid out (prefills first)."""
        self.requests.update(scheduler_output)
        batch.remove_requests(scheduler_output.finished_req_ids)
        batch.remove_requests(scheduler_output.preempted_req_ids)
        # Prefills (query > 1) first, then decodes; stable, so admission order is kept.
        ordered = sorted(scheduler_output.scheduled, key=lambda s: s.num_new_tokens == 1)
        return batch.prepare(ordered, self.requests.by_id), ordered

    def _prepare_lora(self, loras: list[Any], step: StepInputs) -> bool:
        """Slot the step's adapters and set its token mask (every TP rank does the same)."""
        if self.lora_manager is None:
            return False
        return self.lora_manager.prepare_step(loras, step.query_lens_np.tolist())

    def _logits(self, hidden: torch.Tensor, logits_indices: list[int]) -> torch.Tensor:
        n = len(logits_indices)
        if n == hidden.shape[0] and logits_indices == list(range(n)):
            return self.model.compute_logits(hidden)  # a decode step samples every row
        rows = torch.tensor(logits_indices, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))

    @torch.inference_mode()
    def execute_worker_step(self, payload: bytes) -> None:
        """A TP rank other than the driver: the same forward pass as the driver's step, from
        the step message it broadcast (the vocab all-gather of the logits included)."""
        step_message = decode_step(payload)
        step, tables = step_inputs(step_message, self.device)
        self._prepare_lora(step_message.loras, step)
        metadata = self.step_metadata.build(step, tables)
        if (plan := step_message.states) is not None:
            metadata.update(self.recurrent.begin(plan))
        hidden = self._run_eager(step, metadata)
        if plan is not None:
            self.recurrent.finish(plan)
        if step.logits_indices:
            self._logits(hidden, step.logits_indices)  # joins the vocab all-gather

    def shutdown(self) -> None:
        """Release what the runner holds; the other ranks are the executor's to stop."""

    def _run_eager(
        self,
        step: StepInputs,
        attn_metadata: dict[str, AttentionMetadata],
        model_kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """The forward pass without graphs: one batch, or two micro-batches under DP.

        Under DP with an MoE model this step's one DP coordination runs here (this rank's
        micro-batching vote goes into it) and its counts go to the forward context, which then
        runs no collective of its own. When all ranks agree to split, each cuts its token
        stream at half the largest rank's count (so the first micro-batches line up across
        ranks) and runs the model twice.
        """
        parallel = self.config.parallel
        num_tokens = step.num_tokens
        uniform = bool(step.num_reqs) and int(step.query_lens_np.max()) == 1
        counts = coordinate_step_across_dp(
            num_tokens, parallel, parallel.enable_microbatching, uniform_decode=uniform
        )
        if counts is not None and counts.should_ubatch:
            return self._run_ubatches(step, attn_metadata, counts)
        with set_forward_context(
            attn_metadata,
            self.config,
            num_tokens=num_tokens,
            num_tokens_across_dp=None if counts is None else counts.num_tokens_across_dp,
        ):
            model = self.kind_part.forward_model(model_kwargs)
            return model(step.input_ids, step.positions, **(model_kwargs or {}))

    def _run_ubatches(
        self, step: StepInputs, attn_metadata: dict[str, AttentionMetadata], counts: DPStepCounts
    ) -> torch.Tensor:
        """Run the step as two micro-batches (`ubatch_runner`); outputs as for one batch.
        The DBO event trace of the step is kept in `last_ubatch_trace` (None: sequential)."""
        hidden, self.last_ubatch_trace = run_ubatches(
            self.model, self.config, step, attn_metadata, counts
        )
        self.num_ubatched_steps += 1
        return hidden

    @torch.inference_mode()
    def execute_dummy_batch(self, num_tokens: int = 1) -> None:
        """A forward pass over `num_tokens` pad tokens with no KV cache: nothing is written.

        A data-parallel rank with nothing scheduled still runs one so that its MoE layers join
        the other ranks' collectives (with no attention metadata, attention treats the tokens
        as one uncached sequence). This rank's (dummy) count goes into the step's one DP
        coordination, as every rank's does, and the result into the forward context.
        """
        if self.pipeline is not None:
            raise RuntimeError("pipeline parallelism runs no dummy batches (it refuses DP)")
        if self.tp.is_driver and self.tp_size > 1:
            self.tp.broadcast(("dummy", num_tokens))
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, dtype=torch.int64, device=self.device)
        counts = coordinate_step_across_dp(num_tokens, self.config.parallel)
        across = None if counts is None else counts.num_tokens_across_dp
        with set_forward_context(
            None, self.config, num_tokens=num_tokens, num_tokens_across_dp=across
        ):
            self.model(ids, positions)
