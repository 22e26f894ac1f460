"""Encoder-decoder models (BART, Whisper) as pipeline stages: the decoder's layers split over
the stages like any decoder stack's, the encoder on the first stage only.

Why the encoder is not split: it runs once per request (the step that admits it) and its output
is needed whole by every decoder layer's cross-attention, so cutting it into stages would
only add hand-overs. The first stage owns it, as it owns the decoder's embeddings. In a step
where some encoder ran, its output travels on with the decoder's hidden states
(`IntermediateTensors.encoder_hidden_states`), and each stage projects its own layers'
cross-attention K/V from it into its own cross cache; in every other step only the hidden
states travel, and each stage's cross-attention reads what its cache holds.

`StagedDecoder` is what BART's and Whisper's decoder stacks share (this stage's layers, the
forward that embeds on the first stage and hands over before the last); `EncoderDecoderModel`
shows the pipeline part (`runner/pipeline_stages.py`) the decoder's layer range where it looks
for a stack's, on the model's `model`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenwise.layers.pipeline import IntermediateTensors, StageLayers, stage_layers


class StagedDecoder(nn.Module):
    """The decoder layers `[start_layer, end_layer)` of this stage (`StageAbsent` elsewhere).

    A subclass builds them with `build_stage`, then its first-stage embedding (`embed`) and, if
    it has one, its last-stage final step (`finish`, e.g. Whisper's LayerNorm); each layer is
    called as `layer(hidden_states, encoder_hidden_states)`.
    """

    def build_stage(self, num_layers: int, build: Callable[[int], nn.Module]) -> StageLayers:
        stage = stage_layers(num_layers, build)
        self.start_layer, self.end_layer = stage.start, stage.end
        self.is_first_stage, self.is_last_stage = stage.is_first, stage.is_last
        self.layers = stage.layers
        return stage

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def finish(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The last stage's step after the layers (none for a post-LayerNorm stack: BART)."""
        return hidden_states

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """This stage's part of the decoder: from the tokens (first stage, with the encoder
        output of this step's encoders, if any) or from the previous stage's hand-over."""
        if intermediate_tensors is None:
            hidden_states = self.embed(input_ids, positions)
        else:
            hidden_states = intermediate_tensors.hidden_states
            encoder_hidden_states = intermediate_tensors.encoder_hidden_states
        for i in range(self.start_layer, self.end_layer):
            hidden_states = self.layers[i](hidden_states, encoder_hidden_states)
        if not self.is_last_stage:
            return IntermediateTensors(hidden_states, encoder_hidden_states=encoder_hidden_states)
        return self.finish(hidden_states)


class EncoderDecoderModel(nn.Module):
    """`BartModel` / `WhisperModel`: an encoder (first stage) and a `StagedDecoder`, whose layer
    range the pipeline part checks across the stages as it checks any stack's."""

    decoder: StagedDecoder

    @property
    def start_layer(self) -> int:
        return self.decoder.start_layer

    @property
    def end_layer(self) -> int:
        return self.decoder.end_layer

    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers
