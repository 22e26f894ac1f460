"""An encoder-decoder model's part of the runner (BART, Whisper): encoders on top of the
decoder's step.

A step is laid out as for a decoder-only model (the decoder tokens of every scheduled request,
prefills first); on top of that, the requests admitted this step run their encoder in the same
forward pass. The runner hands the model their encoder inputs (token ids and positions, or
audio features) as extra keyword arguments, in step order, and gives the attention layers
metadata of their kind (all keyed by layer name in the forward context):

- encoder self-attention layers: the lengths of the encoders that run this step;
- cross-attention layers: the decoder metadata plus, per decoder sequence, its encoder length
  and cross block table, and the cross slots of this step's encoder tokens (written once).

CUDA graphs (any `cudagraph_mode`): a step in which some request runs its encoder always runs
eagerly, on the uncompiled model. Its encoder inputs are a second token stream (or audio
features) of a length the graphs were never captured for, it writes the cross cache, and it
happens once per request, so a graph would buy little for a second compilation of the model
with its own dynamic size. Every other step goes through the dispatcher as for a decoder-only
model: a uniform decode batch replays a FULL graph whose cross-attention reads the encoder
lengths and cross block tables from `CommonAttentionState`'s encoder-decoder buffers, which
`model_inputs` rewrites before the replay (padding rows: length 1, block 0) through the state's
`prepare_graph_input_buffers`, given the step's graph metadata with its cross fields; a mixed
batch (a chunk of a long decoder prompt) replays PIECEWISE graphs with eager attention on
metadata built here, padded like the decoder's. Models run on one rank, or as pipeline stages:
the driver's part runs the encoders on the first stage, and its cross rows go to the later
stages in the step message (`runner/cross_metadata.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from tokenwise.attention.metadata import AttentionMetadata
from tokenwise.attention.utils import AttentionType, compute_slot_mapping
from tokenwise.compilation.compile import CompiledModel
from tokenwise.engine.block_manager import CROSS_ATTN
from tokenwise.engine.step_outputs import ScheduledRequest
from tokenwise.runner.cross_metadata import with_cross_fields
from tokenwise.runner.input_batch import StepInputs
from tokenwise.runner.kind_part import RunnerKindPart


class EncoderDecoderRunnerPart(RunnerKindPart):
    def setup(self) -> None:
        runner = self.runner
        if runner.tp_size > 1:
            raise ValueError("encoder-decoder models run on one rank")
        self.block_size, self.device = runner.block_size, runner.device
        kinds = {
            name: getattr(layer, "attn_type", AttentionType.DECODER)
            for name, layer in runner.attn_layers.items()
        }
        self.encoder_layers = [n for n, k in kinds.items() if k is AttentionType.ENCODER]
        self.cross_layers = [n for n, k in kinds.items() if k is AttentionType.ENCODER_DECODER]
        if not self.cross_layers:
            raise ValueError(f"{type(runner.model).__name__} has no cross-attention layers")
        self.num_encoder_runs = 0  # requests whose encoder ran, over the runner's life
        # The input batch mirrors each request's cross table too (the block manager's
        # CROSS_ATTN group): metadata and graph buffers read it from there.
        if runner.input_batch.add_kv_cache_group(self.max_cross_blocks_per_seq()) != CROSS_ATTN:
            raise RuntimeError("the input batch's cross-attention group must be CROSS_ATTN")
        # Steps that run an encoder call the model uncompiled (see the module docstring).
        model = runner.model
        self.eager_model = model.model if isinstance(model, CompiledModel) else model

    def max_cross_blocks_per_seq(self) -> int:
        """Blocks of the longest encoder input (the runner's graph runner asks this)."""
        return -(-self.max_encoder_len() // self.runner.block_size)

    def max_encoder_len(self) -> int:
        runner = self.runner
        return int(runner.model.max_encoder_len(runner.model_config.hf_config))

    def model_inputs(self, step: StepInputs, attn_metadata: Any) -> dict[str, Any]:
        runner = self.runner
        ordered = step.scheduled
        # Each request's encoder input, as the runner keeps it (`EncoderDecoderRequest`).
        enc_inputs = [state.kind_inputs.get("encoder_inputs") for state in step.states]
        full_lens = [0 if x is None else x.num_tokens for x in enc_inputs]
        cross_tables = [runner.input_batch.block_ids(int(row), CROSS_ATTN) for row in step.rows]
        if attn_metadata is None:  # a FULL graph replays: its cross rows, into its buffers
            assert runner.graph_runner is not None
            pad = step.num_reqs - len(ordered)
            graph_md = runner.step_metadata.build(
                step, runner.step_metadata.tables(runner.input_batch, step), pad
            )
            decoder_md = graph_md[self.cross_layers[0]]
            cross_md = self._cross_metadata(
                ordered, full_lens, cross_tables, [], decoder_md, step.num_reqs
            )
            runner.graph_runner.prepare_replay(cross_md)
            return {}
        running = [i for i, item in enumerate(ordered) if item.num_encoder_tokens]
        encoders = [ordered[i] for i in running]
        for i in running:
            if ordered[i].num_encoder_tokens != full_lens[i]:
                raise RuntimeError(f"request {ordered[i].req_id}: partial encoder run")
        enc_lens = [item.num_encoder_tokens for item in encoders]
        decoder_md = attn_metadata[self.cross_layers[0]]
        cross_md = self._cross_metadata(
            ordered, full_lens, cross_tables, encoders, decoder_md, step.num_reqs
        )
        encoder_md = self._encoder_metadata(enc_lens)
        for name in self.cross_layers:
            attn_metadata[name] = cross_md
        for name in self.encoder_layers:
            attn_metadata[name] = encoder_md
        self.num_encoder_runs += len(encoders)
        return self._encoder_kwargs([enc_inputs[i] for i in running])

    def _cross_metadata(
        self,
        ordered: list[ScheduledRequest],
        encoder_lens: list[int],
        cross_tables: list[list[int]],
        encoders: list[ScheduledRequest],
        decoder_md: AttentionMetadata,
        num_rows: int,
    ) -> AttentionMetadata:
        """The decoder's metadata plus where each sequence's encoder K/V is (or goes);
        `encoder_lens[i]`: the length of `ordered[i]`'s whole encoder input.

        `num_rows` counts the step's sequences with the padding rows of a piecewise graph, which
        read encoder length 1 through an all-zero cross table, as they read block 0 for their
        own keys.
        """
        dev = self.device
        pad = num_rows - len(ordered)
        tables = cross_tables + [[]] * pad
        table_of = {item.req_id: table for item, table in zip(ordered, cross_tables, strict=True)}
        width = max((len(t) for t in tables), default=0)
        rows = [t + [0] * (width - len(t)) for t in tables]
        cross_tables = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), width)
        slots: list[int] = []
        for i, item in enumerate(encoders):
            table = table_of[item.req_id]
            n = item.num_encoder_tokens
            compute_slot_mapping(False, slots, i, n, 0, 0, self.block_size, {i: table})
        lens = list(encoder_lens) + [1] * pad
        return with_cross_fields(
            decoder_md,
            lens,
            cross_tables.to(dev),
            torch.tensor(slots, dtype=torch.int64, device=dev),
        )

    def may_replay_graphs(self, step: StepInputs) -> bool:
        return not any(item.num_encoder_tokens for item in step.scheduled)

    def forward_model(self, model_kwargs: dict[str, Any] | None) -> Any:
        """A step with encoders runs the uncompiled model; others as for any model."""
        return self.eager_model if model_kwargs else self.runner.model

    def _encoder_metadata(self, enc_lens: list[int]) -> AttentionMetadata:
        """Bounds of the encoders that run this step (their attention keeps no cache)."""
        dev = self.device
        n = len(enc_lens)
        md = AttentionMetadata.for_sequences(
            enc_lens,
            [0] * n,
            torch.empty(0, dtype=torch.int64, device=dev),
            torch.zeros((n, 0), dtype=torch.int32, device=dev),
            num_prefills=n,
            block_size=self.block_size,
        )
        md.num_encoder_tokens = sum(enc_lens)
        md.encoder_seq_lens = list(enc_lens)
        md.encoder_seq_lens_tensor = torch.tensor(enc_lens, dtype=torch.int32, device=dev)
        md.max_encoder_seq_len = max(enc_lens, default=0)
        return md

    def _encoder_kwargs(self, inputs: list[Any]) -> dict[str, Any]:
        """The model's encoder inputs (of the requests whose encoder runs): none when no
        encoder runs (decoder steps only)."""
        if not inputs:
            return {}
        if inputs[0] is not None and inputs[0].input_features is not None:
            feats = [x.input_features for x in inputs if x is not None]
            return {"encoder_input_features": torch.stack(feats).to(self.device)}
        ids: list[int] = []
        positions: list[int] = []
        for x in inputs:
            assert x is not None and x.token_ids is not None
            ids += x.token_ids
            positions += range(len(x.token_ids))
        return {
            "encoder_input_ids": torch.tensor(ids, dtype=torch.int64, device=self.device),
            "encoder_positions": torch.tensor(positions, dtype=torch.int64, device=self.device),
        }
