"""Per-step CUDA-graph dispatch: pick a graph for the step, run it (docs/forward-context.md §2).

The model runner asks `plan` for a runtime mode and padded `BatchDescriptor` (the
`CUDAGraphDispatcher` decides), pads the step in its input batch, and calls `execute`:

- FULL (uniform decode batches, and uniform verification batches laid out as one decode row
  per query token; also in plain FULL mode, whose mixed batches run eagerly): the
  whole model was captured, attention included, on the input batch's own persistent buffers
  (bound into `CommonAttentionState`). The step is already written there, padded with PAD
  slots and length-1 sequences; the forward context carries the capture's metadata (which
  views those buffers), and the graph replays. Nothing is copied for it.
- PIECEWISE (mixed batches): the compiled pieces between attention calls replay their graphs;
  attention runs eagerly on metadata built over the same padded buffers.
- NONE (batches above the largest capture size, or no graph captured for this shape): the
  model runs eagerly on the unpadded batch.

Padding rows are extra one-token "decode" sequences whose slot is PAD_SLOT_ID, so their K/V go
to the backend's trash block and never into a block the block manager hands out; they read block
0 (harmlessly) and their outputs are dropped.

Encoder-decoder models (`max_cross_blocks_per_seq` > 0) capture on metadata that also carries
the cross fields, over `CommonAttentionState`'s encoder-decoder buffers (per-row encoder length
and cross block table); their runner writes those rows before each FULL replay through
`prepare_replay` (the state's `prepare_graph_input_buffers`) and runs every step with an encoder
eagerly (`encoder_decoder_runner.py`). Each graph step calls the state's `begin_forward` first.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tokenwise.attention.graph_state import CommonAttentionState
from tokenwise.attention.metadata import AttentionMetadata
from tokenwise.compilation.cpu_graph import GraphCaptureRejected
from tokenwise.compilation.cuda_graph import CapturerFactory, CUDAGraphWrapper
from tokenwise.compilation.cuda_graph_dispatcher import CUDAGraphDispatcher
from tokenwise.config import CUDAGraphMode, EngineConfig
from tokenwise.distributed.dp_coordination import coordinate_step_across_dp
from tokenwise.forward_context import BatchDescriptor, set_forward_context
from tokenwise.lora.layers import LoRAState
from tokenwise.runner.graph_setup import (
    check_cudagraph_config,
    default_capture_sizes,
    graph_rows,
)
from tokenwise.runner.input_batch import InputBatch

logger = logging.getLogger(__name__)


class CUDAGraphRunner:
    """Captures the model's graphs once, then runs every step through the dispatcher.

    `model` is what the model runner would call (compiled piecewise when the mode has
    PIECEWISE graphs: its pieces are already wrapped). `layer_specs` maps each attention layer
    to its spec (the sliding window); whole-model FULL graphs need every layer to share the
    spec without a window, because the persistent metadata buffers hold one untrimmed block
    table per row. `backend` is the attention backend class, asked whether its decode is
    graph-safe.
    """

    def __init__(
        self,
        model: Any,
        config: EngineConfig,
        device: torch.device,
        capturer_factory: CapturerFactory,
        layer_specs: dict[str, int | None],
        backend: Any,
        input_batch: InputBatch,
        lora_state: LoRAState | None = None,
        max_cross_blocks_per_seq: int = 0,
        verify_query_len: int | None = None,
        num_groups: int = 1,
    ) -> None:
        compilation = config.compilation
        mode = compilation.cudagraph_mode
        if mode == CUDAGraphMode.NONE:
            raise ValueError("CUDAGraphRunner needs a cudagraph_mode other than NONE")
        check_cudagraph_config(config, backend)
        if mode.requires_piecewise_compilation() and not getattr(model, "piecewise", False):
            raise ValueError(
                f"cudagraph_mode={mode.name} needs the model compiled piecewise "
                "(CompilationConfig.piecewise_compile must not be False)"
            )
        self.config = config
        self.model = model
        self.device = device
        scheduler = config.scheduler
        if compilation.cudagraph_capture_sizes is None:
            compilation.cudagraph_capture_sizes = default_capture_sizes(
                graph_rows(config), scheduler.max_num_batched_tokens, str(config.device)
            )
        self.capture_sizes = list(compilation.cudagraph_capture_sizes)
        max_size = compilation.max_capture_size
        # Sliding-window layers trim their block tables per step; the FULL graph's persistent
        # buffers hold untrimmed rows, so such models replay piecewise graphs only.
        # So do models with several KV-cache groups: each group has tables of its own.
        self.disable_full = num_groups > 1 or any(spec is not None for spec in layer_specs.values())
        if self.disable_full and mode.has_full_cudagraphs():
            logger.warning(
                "sliding-window attention: FULL CUDA graphs disabled, mixed-batch graphs only"
            )
        self.layer_names = list(layer_specs)
        # Decode graphs up to `graph_rows` rows: on CPU, verifying steps replay them too.
        self.dispatcher = CUDAGraphDispatcher(compilation, graph_rows(config))
        # Uniform verification batches (every request 1 + k tokens) get FULL keys of their own;
        # the model runner lays such a step out as decode rows (`verify_rows.py`), so each
        # replays the decode graph of its size (`_graph_key`).
        self.verify_query_len = None if self.disable_full else verify_query_len
        self.dispatcher.initialize_cudagraph_keys(mode, verify_query_len=self.verify_query_len)
        self.lora_state = lora_state
        if lora_state is not None:
            self.dispatcher.add_lora_keys()
        # Graphs read the input batch's own device buffers: a step's inputs are written there
        # once, and replay needs no copy into buffers of the graph's own.
        if max_size > min(input_batch.max_num_reqs, input_batch.max_num_tokens):
            raise ValueError(
                f"capture size {max_size} exceeds the input batch ({input_batch.max_num_reqs} "
                f"sequences, {input_batch.max_num_tokens} tokens)"
            )
        self.input_batch = input_batch
        self.input_ids = input_batch.input_ids.device
        self.positions = input_batch.positions.device
        # Cross-attention layers read encoder lengths and cross tables: graph buffers for them.
        self.has_cross_attention = max_cross_blocks_per_seq > 0
        self.attn_state = CommonAttentionState(
            max_size,
            input_batch.max_blocks,
            config.cache.block_size,
            device,
            max_cross_blocks_per_seq=max_cross_blocks_per_seq,
        )
        self.attn_state.bind_buffers(
            input_batch.slot_mapping.device,
            input_batch.seq_lens.device,
            input_batch.block_tables.device,
        )
        self.full_model = CUDAGraphWrapper(
            model, CUDAGraphMode.FULL, capturer_factory, [True, True], "model", True
        )
        self._graph_metadata: dict[int, AttentionMetadata] = {}
        # What each captured FULL size reads (`get_graph_input_buffers`), for `prepare_replay`.
        self._graph_buffers: dict[int, dict[str, torch.Tensor]] = {}
        self.captured = False  # set by `capture`: no step replays a graph before it
        # Recurrent-state layers' slot buffers (`recurrent_graph.py`), set by the model runner.
        self.recurrent: Any = None
        # FULL keys whose capture was refused, and why (those batches run eagerly).
        self.rejected: dict[BatchDescriptor, str] = {}

    # ---- capture --------------------------------------------------------------------------

    def measure(self) -> int:
        """Device bytes the graphs will take, measured by capturing them on the bound cache.

        KV sizing calls this with a one-block placeholder cache bound, before the real cache
        exists. Piecewise graphs never read the cache, so they stay captured; full graphs hold
        the placeholder's address, so they are dropped here and `capture` records them again
        on the real cache (their memory stays in the shared pool for that). 0 off CUDA, where
        tests fake capture and there is no device memory to read.
        """
        free_before = _free_device_memory(self.device)
        self._capture_all()
        free_after = _free_device_memory(self.device)
        self.full_model.entries.clear()
        self._graph_metadata.clear()
        self._graph_buffers.clear()
        return max(0, free_before - free_after)

    def capture(self) -> None:
        """Capture a graph for every key the dispatcher may return, on the real KV cache."""
        self._capture_all()
        self.captured = True

    def _capture_all(self) -> None:
        """Capture every key (largest first); keys already captured replay instead."""
        keys = self.dispatcher.keys
        full_keys = {self._graph_key(desc) for desc in keys[CUDAGraphMode.FULL]}
        full = [] if self.disable_full else sorted(full_keys, reverse=True)
        piecewise = sorted(keys[CUDAGraphMode.PIECEWISE], reverse=True)
        state, enc_dec = self.attn_state, self.has_cross_attention
        parallel = self.config.parallel
        if self.recurrent is not None:
            self.recurrent.capturing()
        with state.graph_capture(state.max_batch_size, enc_dec), torch.inference_mode():
            for desc in full:
                md = self._metadata_for_capture(desc.num_tokens)
                self._set_lora_active(desc.has_lora)
                across = _dp_counts(desc.num_tokens, parallel)
                try:
                    self._forward(desc.num_tokens, md, CUDAGraphMode.FULL, desc, across)
                except GraphCaptureRejected as exc:
                    self._drop_full_key(desc, str(exc))
            for desc in piecewise:
                md = state.graph_capture_get_metadata_for_batch(desc.num_tokens, enc_dec)
                self._set_lora_active(desc.has_lora)
                across = _dp_counts(desc.num_tokens, parallel)
                self._forward(desc.num_tokens, md, CUDAGraphMode.PIECEWISE, desc, across)
        self._set_lora_active(False)
        kind = "CPU" if self.device.type == "cpu" else "CUDA"
        logger.info(
            "captured %d full and %d piecewise %s-graph sizes (largest %d tokens)",
            len(full) - len(self.rejected),
            len(piecewise),
            kind,
            max(self.capture_sizes),
        )

    def _drop_full_key(self, key: BatchDescriptor, reason: str) -> None:
        """A FULL graph that cannot be captured (a CPU graph refused: see `cpu_graph`): its
        batches, and the verify batches that would replay it, run eagerly instead."""
        keys = self.dispatcher.keys[CUDAGraphMode.FULL]
        for desc in [d for d in keys if self._graph_key(d) == key]:
            keys.discard(desc)
        self.rejected[key] = reason
        logger.info("no graph for decode batches of %d: %s", key.num_tokens, reason)

    def _set_lora_active(self, active: bool) -> None:
        """LoRA graphs are captured with the adapters' matmuls in them, base graphs without."""
        if self.lora_state is not None:
            self.lora_state.active = active

    def _metadata_for_capture(self, size: int) -> AttentionMetadata:
        md = self._graph_metadata.get(size)
        if md is None:
            state, enc_dec = self.attn_state, self.has_cross_attention
            md = state.graph_capture_get_metadata_for_batch(size, enc_dec)
            self._graph_metadata[size] = md
            self._graph_buffers[size] = state.get_graph_input_buffers(md, enc_dec)
        return md

    def prepare_replay(self, attn_metadata: AttentionMetadata) -> None:
        """Write a step's rows into the buffers of the FULL graph it replays.

        `attn_metadata` is the padded step's graph metadata (`use_cuda_graph`, as many rows as
        the graph). A decoder's inputs already are in the bound buffers (nothing is copied);
        an encoder-decoder step's encoder lengths and cross block tables are copied in.
        """
        size = attn_metadata.num_decode_tokens
        buffers = self._graph_buffers.get(size)
        if buffers is None or attn_metadata.num_prefills:
            raise ValueError(f"no FULL graph was captured for a decode batch of {size}")
        self.attn_state.prepare_graph_input_buffers(
            buffers, attn_metadata, self.has_cross_attention
        )

    # ---- one step -------------------------------------------------------------------------

    def plan(
        self, num_tokens: int, uniform_decode: bool, has_lora: bool = False, query_len: int = 1
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """How this step runs: which graph (if any) and the token count it is padded to.

        `query_len` is what every request of a uniform batch runs: 1 for decode, 1 + k for a
        verification batch (whose FULL graph the runner replays over decode rows). A batch
        using an adapter has its own key (`has_lora`), captured only when LoRA is configured.
        """
        # Whole-model graphs are captured on decode-only metadata; a batch with prefills (which
        # plain FULL mode would also dispatch to them) needs eager attention, so it never
        # replays one.
        return self.dispatcher.dispatch(
            num_tokens,
            uniform_decode=uniform_decode,
            has_lora=has_lora,
            disable_full=self.disable_full or not uniform_decode,
            uniform_query_len=query_len,
        )

    def execute(
        self,
        mode: CUDAGraphMode,
        desc: BatchDescriptor,
        attn_metadata: dict[str, AttentionMetadata] | None,
        num_tokens: int,
    ) -> torch.Tensor:
        """Hidden states of the `num_tokens` real rows (valid until the next step).

        The step's inputs are already in the input batch's buffers, padded to
        `desc.num_tokens` when a graph runs. FULL graphs replay on their capture metadata,
        which views those same buffers (`attn_metadata` is not needed then). Under DP with an
        MoE model, this is where the step's one DP coordination runs (on the padded size the
        graph runs), and its counts go to the forward context.
        """
        if mode != CUDAGraphMode.NONE and not self.captured:
            raise RuntimeError(
                f"a {mode.name} graph was asked for before CUDAGraphRunner.capture() (the model "
                "runner captures in initialize_kv_cache, once the KV cache exists)"
            )
        size = num_tokens if mode == CUDAGraphMode.NONE else desc.num_tokens
        across = _dp_counts(size, self.config.parallel)
        if mode == CUDAGraphMode.NONE:
            with set_forward_context(
                attn_metadata, self.config, num_tokens=size, num_tokens_across_dp=across
            ):
                return self.model(self.input_ids[:size], self.positions[:size])
        self.attn_state.begin_forward(attn_metadata)
        step_md: Any = attn_metadata
        if mode == CUDAGraphMode.FULL:
            step_md = self._graph_metadata[size]
        return self._forward(size, step_md, mode, desc, across)[:num_tokens]

    def _forward(
        self,
        size: int,
        attn_metadata: Any,
        mode: CUDAGraphMode,
        desc: BatchDescriptor,
        num_tokens_across_dp: torch.Tensor | None,
    ) -> torch.Tensor:
        if isinstance(attn_metadata, AttentionMetadata):
            attn_metadata = {name: attn_metadata for name in self.layer_names}
            if self.recurrent is not None and mode == CUDAGraphMode.FULL:
                attn_metadata.update(self.recurrent.metadata(size))
        with set_forward_context(
            attn_metadata,
            self.config,
            num_tokens=size,
            num_tokens_across_dp=num_tokens_across_dp,
            cudagraph_runtime_mode=mode,
            batch_descriptor=self._graph_key(desc),
        ):
            return self.full_model(self.input_ids[:size], self.positions[:size])

    def _graph_key(self, desc: BatchDescriptor) -> BatchDescriptor:
        """The key of the graph `desc` replays: itself, except that a verify key (uniform, fewer
        requests than tokens) replays the decode graph of its size when one is captured; the
        runner hands both the same decode rows in the same buffers, so one graph serves both."""
        if desc.uniform and desc.num_reqs != desc.num_tokens:
            decode = desc._replace(num_reqs=desc.num_tokens)
            if decode in self.dispatcher.keys[CUDAGraphMode.FULL]:
                return decode
        return desc


def _dp_counts(num_tokens: int, parallel: Any) -> torch.Tensor | None:
    """Every DP rank's count for a graph step or capture (None when nothing needs them).

    Graph steps never micro-batch, so this is the whole of the step's DP coordination.
    """
    counts = coordinate_step_across_dp(num_tokens, parallel)
    return None if counts is None else counts.num_tokens_across_dp


def _free_device_memory(device: torch.device) -> int:
    """Free bytes on the device, all processes counted (0 off CUDA: tests fake graphs)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return int(torch.cuda.mem_get_info(device)[0])
