"""The runner of an encoder-decoder model (BART, Whisper): the decoder runner plus encoders.

A step is laid out as for a decoder-only model (the decoder tokens of every scheduled request,
prefills first); on top of that, the requests admitted this step run their encoder in the same
forward pass. The runner hands the model their encoder inputs (token ids and positions, or
audio features) as extra keyword arguments, in step order, and gives the attention layers
metadata of their kind (all keyed by layer name in the forward context):

- encoder self-attention layers: the lengths of the encoders that run this step;
- cross-attention layers: the decoder metadata plus, per decoder sequence, its encoder length
  and cross block table, and the cross slots of this step's encoder tokens (written once).

Encoder-decoder models run eagerly on one rank (`build_engine_config` says so).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tokenwise.attention.attn_metadata import AttentionMetadata
from tokenwise.attention.utils import AttentionType, compute_slot_mapping
from tokenwise.config import EngineConfig
from tokenwise.engine.input_batch import StepInputs
from tokenwise.engine.model_runner import ModelRunner
from tokenwise.engine.step_outputs import ScheduledRequest


class EncoderDecoderModelRunner(ModelRunner):
    def __init__(self, config: EngineConfig, device: str | torch.device = "cpu") -> None:
        super().__init__(config, device)
        if self._capturer_factory is not None or self.tp_size > 1:
            raise ValueError("encoder-decoder models run eagerly on one rank")
        kinds = {
            name: getattr(layer, "attn_type", AttentionType.DECODER)
            for name, layer in self.attn_layers.items()
        }
        self.encoder_layers = [n for n, k in kinds.items() if k is AttentionType.ENCODER]
        self.cross_layers = [n for n, k in kinds.items() if k is AttentionType.ENCODER_DECODER]
        if not self.cross_layers:
            raise ValueError(f"{type(self.model).__name__} has no cross-attention layers")
        self.num_encoder_runs = 0  # requests whose encoder ran, over the runner's life

    def max_encoder_len(self) -> int:
        return int(self.model.max_encoder_len(self.model_config.hf_config))

    def _model_inputs(
        self,
        ordered: list[ScheduledRequest],
        step: StepInputs,
        attn_metadata: dict[str, AttentionMetadata] | None,
    ) -> dict[str, Any]:
        if attn_metadata is None:
            raise ValueError("encoder-decoder steps need attention metadata (no full graphs)")
        encoders = [item for item in ordered if item.num_encoder_tokens]
        for item in encoders:
            if item.num_encoder_tokens != item.request.num_encoder_tokens:
                raise RuntimeError(f"request {item.request.request_id}: partial encoder run")
        enc_lens = [item.num_encoder_tokens for item in encoders]
        decoder_md = attn_metadata[self.cross_layers[0]]
        cross_md = self._cross_metadata(ordered, encoders, decoder_md)
        encoder_md = self._encoder_metadata(enc_lens)
        for name in self.cross_layers:
            attn_metadata[name] = cross_md
        for name in self.encoder_layers:
            attn_metadata[name] = encoder_md
        self.num_encoder_runs += len(encoders)
        return self._encoder_kwargs(encoders)

    def _cross_metadata(
        self,
        ordered: list[ScheduledRequest],
        encoders: list[ScheduledRequest],
        decoder_md: AttentionMetadata,
    ) -> AttentionMetadata:
        """The decoder's metadata plus where each sequence's encoder K/V is (or goes)."""
        dev = self.device
        tables = [item.request.cross_block_table for item in ordered]
        width = max((len(t) for t in tables), default=0)
        rows = [t + [0] * (width - len(t)) for t in tables]
        cross_tables = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), width)
        slots: list[int] = []
        for i, item in enumerate(encoders):
            table = item.request.cross_block_table
            n = item.num_encoder_tokens
            compute_slot_mapping(False, slots, i, n, 0, 0, self.block_size, {i: table})
        lens = [item.request.num_encoder_tokens for item in ordered]
        return dataclasses.replace(
            decoder_md,
            num_encoder_tokens=len(slots),
            encoder_seq_lens=lens,
            encoder_seq_lens_tensor=torch.tensor(lens, dtype=torch.int32, device=dev),
            max_encoder_seq_len=max(lens, default=0),
            cross_slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            cross_block_tables=cross_tables.to(dev),
        )

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

    def _encoder_kwargs(self, encoders: list[ScheduledRequest]) -> dict[str, Any]:
        """The model's encoder inputs: none when no encoder runs (decoder steps only)."""
        if not encoders:
            return {}
        inputs = [item.request.encoder_inputs for item in encoders]
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
