"""Per-step CUDA-graph dispatch: pad the batch, pick a graph, run it (SPEC §2).

The model runner hands each step's flat inputs and attention metadata to `CudaGraphRunner.run`,
which asks the `CudagraphDispatcher` for a runtime mode and padded `BatchDescriptor`:

- FULL (uniform decode batches; also in plain FULL mode, whose mixed batches run eagerly): the
  whole model was captured, attention included, against the
  persistent buffers of `CommonAttentionState`. The real batch, padded with PAD slots and
  length-1 sequences, is copied into those buffers; the forward context carries the capture's
  metadata (which points at them), and the graph replays.
- PIECEWISE (mixed batches): the compiled pieces between attention calls replay their graphs;
  attention runs eagerly on metadata padded the same way.
- NONE (batches above the largest capture size, or no graph captured for this shape): the
  model runs eagerly on the unpadded batch.

Padding rows are extra one-token "decode" sequences whose slot is PAD_SLOT_ID, so their K/V go
to the backend's trash block and never into a block the block manager hands out; they read block
0 (harmlessly) and their outputs are dropped. Inputs go into persistent buffers because a
captured graph reads fixed addresses.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tokenwise.attention.backends.selector import get_attn_backend
from tokenwise.attention.graph_state import CommonAttentionState
from tokenwise.attention.metadata import AttentionMetadata
from tokenwise.attention.utils import PAD_SLOT_ID
from tokenwise.compilation.cuda_graph import CapturerFactory, CUDAGraphWrapper
from tokenwise.compilation.cudagraph_dispatcher import CudagraphDispatcher
from tokenwise.config import CUDAGraphMode, EngineConfig
from tokenwise.engine.graph_setup import check_cudagraph_config, default_capture_sizes
from tokenwise.forward_context import BatchDescriptor, set_forward_context

logger = logging.getLogger(__name__)


def pad_attention_metadata(md: AttentionMetadata, pad: int) -> AttentionMetadata:
    """`md` with `pad` one-token decode sequences appended (PAD slot, length 1, block 0)."""
    if pad == 0:
        return md
    if pad < 0:
        raise ValueError(f"pad must be >= 0, got {pad}")
    dev = md.slot_mapping.device

    def extend(t: torch.Tensor | None, value: int) -> torch.Tensor | None:
        if t is None:
            return None
        return torch.cat([t, torch.full((pad,), value, dtype=t.dtype, device=t.device)])

    def extend_cumulative(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        steps = torch.arange(1, pad + 1, dtype=t.dtype, device=t.device)
        return torch.cat([t, t[-1:] + steps])

    tables = md.block_tables
    padded_tables = torch.cat(
        [tables, torch.zeros((pad, tables.shape[1]), dtype=tables.dtype, device=tables.device)]
    )
    return AttentionMetadata(
        num_prefills=md.num_prefills,
        num_prefill_tokens=md.num_prefill_tokens,
        num_decode_tokens=md.num_decode_tokens + pad,
        slot_mapping=torch.cat(
            [md.slot_mapping, torch.full((pad,), PAD_SLOT_ID, dtype=torch.int64, device=dev)]
        ),
        seq_lens=None if md.seq_lens is None else md.seq_lens + [1] * pad,
        seq_lens_tensor=extend(md.seq_lens_tensor, 1),
        max_query_len=max(md.max_query_len, 1),
        max_prefill_seq_len=md.max_prefill_seq_len,
        max_decode_seq_len=max(md.max_decode_seq_len, 1),
        query_start_loc=extend_cumulative(md.query_start_loc),
        seq_start_loc=extend_cumulative(md.seq_start_loc),
        context_lens_tensor=extend(md.context_lens_tensor, 0),
        block_tables=padded_tables,
        use_cuda_graph=md.use_cuda_graph,
        query_lens=md.query_lens + [1] * pad,
        context_lens=md.context_lens + [0] * pad,
        block_table_first_block=md.block_table_first_block + [0] * pad,
        block_size=md.block_size,
        sliding_window=md.sliding_window,
    )


class CudaGraphRunner:
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
        max_model_len: int,
    ) -> None:
        compilation = config.compilation
        mode = compilation.cudagraph_mode
        if mode == CUDAGraphMode.NONE:
            raise ValueError("CudaGraphRunner needs a cudagraph_mode other than NONE")
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
                scheduler.max_num_seqs, scheduler.max_num_batched_tokens
            )
        self.capture_sizes = list(compilation.cudagraph_capture_sizes)
        max_size = compilation.max_capture_size
        # Sliding-window layers trim their block tables per step; the FULL graph's persistent
        # buffers hold untrimmed rows, so such models replay piecewise graphs only.
        self.disable_full = any(spec is not None for spec in layer_specs.values())
        if self.disable_full and mode.has_full_cudagraphs():
            logger.warning(
                "sliding-window attention: FULL CUDA graphs disabled, mixed-batch graphs only"
            )
        self.layer_names = list(layer_specs)
        self.dispatcher = CudagraphDispatcher(compilation, scheduler.max_num_seqs)
        self.dispatcher.initialize_cudagraph_keys(mode)
        # Inference tensors, like the inputs `execute_model` makes under inference_mode: a
        # compiled model guards on the dispatch keys, and normal tensors would recompile it.
        with torch.inference_mode():
            self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=device)
            self.positions = torch.zeros(max_size, dtype=torch.int64, device=device)
        block_size = config.cache.block_size
        self.attn_state = CommonAttentionState(
            max_size, -(-max_model_len // block_size), block_size, device
        )
        self.full_model = CUDAGraphWrapper(
            model, CUDAGraphMode.FULL, capturer_factory, [True, True], "model", True
        )
        self._graph_metadata: dict[int, AttentionMetadata] = {}
        self._graph_buffers: dict[int, dict[str, torch.Tensor]] = {}

    @classmethod
    def for_model_runner(cls, runner: Any, capturer_factory: CapturerFactory) -> CudaGraphRunner:
        """The graph runner of a `ModelRunner` whose KV cache is allocated."""
        return cls(
            runner.model,
            runner.config,
            runner.device,
            capturer_factory,
            runner._spec_of,
            get_attn_backend(runner.config),
            runner.model_config.max_model_len,
        )

    # ---- capture --------------------------------------------------------------------------

    def capture_model(self) -> None:
        """Capture a graph for every key the dispatcher may return (largest first)."""
        keys = self.dispatcher.keys
        full = [] if self.disable_full else sorted(keys[CUDAGraphMode.FULL], reverse=True)
        piecewise = sorted(keys[CUDAGraphMode.PIECEWISE], reverse=True)
        with self.attn_state.graph_capture(self.attn_state.max_batch_size), torch.inference_mode():
            for desc in full:
                md = self._metadata_for_capture(desc.num_tokens)
                self._forward(desc.num_tokens, md, CUDAGraphMode.FULL, desc)
            for desc in piecewise:
                md = self.attn_state.graph_capture_get_metadata_for_batch(desc.num_tokens)
                self._forward(desc.num_tokens, md, CUDAGraphMode.PIECEWISE, desc)
        logger.info(
            "captured %d full and %d piecewise CUDA-graph sizes (largest %d tokens)",
            len(full),
            len(piecewise),
            max(self.capture_sizes),
        )

    def _metadata_for_capture(self, size: int) -> AttentionMetadata:
        md = self._graph_metadata.get(size)
        if md is None:
            md = self.attn_state.graph_capture_get_metadata_for_batch(size)
            self._graph_metadata[size] = md
            self._graph_buffers[size] = self.attn_state.get_graph_input_buffers(md)
        return md

    # ---- one step -------------------------------------------------------------------------

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: dict[str, AttentionMetadata],
        num_tokens: int,
    ) -> torch.Tensor:
        """Hidden states of the `num_tokens` real rows (valid until the next step)."""
        first = next(iter(attn_metadata.values()))
        uniform = first.num_prefills == 0 and first.num_decode_tokens == num_tokens
        # Whole-model graphs are captured on decode-only metadata; a batch with prefills (which
        # plain FULL mode would also dispatch to them) needs eager attention, so it never
        # replays one.
        mode, desc = self.dispatcher.dispatch(
            num_tokens, uniform_decode=uniform, disable_full=self.disable_full or not uniform
        )
        if mode == CUDAGraphMode.NONE:
            with set_forward_context(attn_metadata, self.config, num_tokens=num_tokens):
                return self.model(input_ids, positions)
        padded_size = desc.num_tokens
        self.input_ids[:num_tokens].copy_(input_ids)
        self.input_ids[num_tokens:padded_size].zero_()
        self.positions[:num_tokens].copy_(positions)
        self.positions[num_tokens:padded_size].zero_()
        pad = padded_size - num_tokens
        padded = {id(md): pad_attention_metadata(md, pad) for md in attn_metadata.values()}
        if mode == CUDAGraphMode.FULL:
            (md,) = padded.values()  # FULL graphs exist only when all layers share one spec
            self.attn_state.prepare_graph_input_buffers(self._graph_buffers[padded_size], md)
            graph_md = self._graph_metadata[padded_size]
            step_md: Any = {name: graph_md for name in attn_metadata}
        else:
            step_md = {name: padded[id(md)] for name, md in attn_metadata.items()}
        hidden = self._forward(padded_size, step_md, mode, desc)
        return hidden[:num_tokens]

    def _forward(
        self,
        size: int,
        attn_metadata: Any,
        mode: CUDAGraphMode,
        desc: BatchDescriptor,
    ) -> torch.Tensor:
        if isinstance(attn_metadata, AttentionMetadata):
            attn_metadata = {name: attn_metadata for name in self.layer_names}
        with set_forward_context(
            attn_metadata,
            self.config,
            num_tokens=size,
            cudagraph_runtime_mode=mode,
            batch_descriptor=desc,
        ):
            return self.full_model(self.input_ids[:size], self.positions[:size])
