"""What a model needs to run as one stage of a pipeline (`tokenwise.distributed.pp_state`).

`StageAbsent` stands where a module of another stage would be (a decoder layer, the embedding,
the final norm, the LM head): it has no parameters, so the stage neither allocates nor loads
it, and the modules it does hold keep their checkpoint names and indices (`model.layers.5` on
the second stage is still layer 5). `IntermediateTensors` is what one stage hands the next.
What it carries depends on the family, which is why all but the hidden states are optional:
- `residual`: the running residual not yet added (Llama-style layers defer each add into the
  next norm, which fuses it); families whose layers add their own output (Gemma, the Gated
  DeltaNet hybrids) have none, and the channel then sends nothing for it.
- `per_layer_inputs`: Gemma 4's per-layer embeddings of the layers after the sender's, which
  only the first stage can compute (they mix a projection of the token embedding in).
- `encoder_hidden_states`: an encoder-decoder model's encoder output (BART, Whisper), in a
  step where some request's encoder ran on the first stage: every later stage projects its own
  layers' cross-attention K/V from it.

`PipelineStack` builds a decoder stack's layers for this stage (`build_stage`) and runs them,
`PipelineForCausalLM` passes a stage's input on to it, and `stage_weights` hands the weight
loaders the checkpoint tensors the stage holds: each family's model only says which of its
modules sit on the first and on the last stage (`only_on`, `stage_lm_head`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from tokenwise.distributed.pp_state import is_first_pp_stage, is_last_pp_stage, pp_layer_range
from tokenwise.layers.embedding import ParallelLMHead, VocabParallelEmbedding


class IntermediateTensors(NamedTuple):
    hidden_states: torch.Tensor
    residual: torch.Tensor | None = None
    per_layer_inputs: torch.Tensor | None = None
    encoder_hidden_states: torch.Tensor | None = None

    def present(self) -> dict[str, torch.Tensor]:
        """The tensors this message carries, by field name (what the channel sends)."""
        return {name: t for name, t in self._asdict().items() if t is not None}

    def to(self, device: str | torch.device) -> IntermediateTensors:
        return IntermediateTensors(**{name: t.to(device) for name, t in self.present().items()})


class StageAbsent(nn.Module):
    """A placeholder for a module another pipeline stage holds; calling it is a bug."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("this module belongs to another pipeline stage")


class StageLayers(NamedTuple):
    """This stage's part of a decoder stack: layers `[start, end)` of the ModuleList `layers`
    (the other indices hold `StageAbsent`), and whether it is the first / last stage."""

    start: int
    end: int
    is_first: bool
    is_last: bool
    layers: nn.ModuleList


def stage_layers(num_layers: int, build: Callable[[int], nn.Module]) -> StageLayers:
    """Build the layers this stage holds (`build(i)` for each of its indices, in order)."""
    start, end = pp_layer_range(num_layers)
    layers = nn.ModuleList(
        build(i) if start <= i < end else StageAbsent() for i in range(num_layers)
    )
    return StageLayers(start, end, is_first_pp_stage(), is_last_pp_stage(), layers)


class PipelineStack(nn.Module):
    """A decoder stack that may run as pipeline stages: `build_stage` builds this stage's
    layers and records what the runner and the loaders read (`start_layer`, `end_layer`,
    `is_first_stage`, `is_last_stage`, `layers` with every index, `stage`). The subclass also
    builds `embed_tokens` (first stage) and `norm` (last stage), each `only_on` its stage.

    Its `forward` is that of layers which add their own output (`layer(positions, hidden)`:
    Gemma's, the Gated DeltaNet hybrids'), so that only the hidden states go between stages;
    stacks with a deferred residual or more to hand on override it."""

    embed_tokens: nn.Module
    norm: nn.Module

    def build_stage(self, num_layers: int, build: Callable[[int], nn.Module]) -> StageLayers:
        stage = self.stage = stage_layers(num_layers, build)
        self.start_layer, self.end_layer = stage.start, stage.end
        self.is_first_stage, self.is_last_stage = stage.is_first, stage.is_last
        self.layers = stage.layers
        return stage

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """`inputs_embeds` (a multimodal model's, image rows merged in) replace the embedding
        of `input_ids`; on a later stage the previous stage's output replaces both."""
        if intermediate_tensors is not None:
            hidden_states = intermediate_tensors.hidden_states
        else:
            hidden_states = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        for i in range(self.start_layer, self.end_layer):
            hidden_states = self.layers[i](positions, hidden_states)
        if not self.is_last_stage:
            return IntermediateTensors(hidden_states)
        return self.norm(hidden_states)


class PipelineForCausalLM(nn.Module):
    """A causal LM over a `PipelineStack` (`self.model`): its forward passes the previous
    stage's output on, and returns this stage's (`IntermediateTensors` before the last)."""

    model: PipelineStack

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors=intermediate_tensors)


def only_on(held: bool, build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` where this stage holds the module (e.g. `is_first` for the embedding), else a
    `StageAbsent`: nothing is allocated for another stage's module."""
    return build() if held else StageAbsent()


def stage_lm_head(stack: PipelineStack, hf_config: Any, tied: bool) -> tuple[nn.Module, bool]:
    """The LM head over `stack` on the last stage (`StageAbsent` elsewhere), and whether it
    loads from the embedding's tensor: a tied head on a last stage without the embedding
    (`stack.embed_tokens`) owns its copy."""
    if not stack.is_last_stage:
        return StageAbsent(), False
    embedding = stack.embed_tokens
    tie_to = embedding if tied and isinstance(embedding, VocabParallelEmbedding) else None
    head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tie_to=tie_to)
    return head, tied and tie_to is None


def held_by_stage(root: nn.Module, name: str) -> bool:
    """Whether checkpoint tensor `name` belongs to a module this stage holds.

    Walks the name's dotted path down from `root` and answers False at the first
    `StageAbsent`. A path that leaves the module tree before that (a checkpoint name the loader
    maps onto a fused parameter, like `q_proj` into `qkv_proj`) counts as held: the loader
    places or refuses it as without pipeline parallelism.
    """
    module = root
    for part in name.split(".")[:-1]:
        if isinstance(module, StageAbsent):
            return False
        child = module._modules.get(part)
        if child is None:
            return True
        module = child
    return not isinstance(module, StageAbsent)


def stage_weights(
    root: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    head_from_embedding: bool = False,
    embedding: str = "model.embed_tokens.weight",
    head: str = "lm_head.weight",
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors this stage holds. `head_from_embedding`: the model ties its LM
    head to the embedding, and this stage has the head but not the embedding, so it owns a
    copy of the head, loaded from the embedding's tensor (`embedding`) as `head`."""
    for name, tensor in weights:
        if head_from_embedding and name == embedding:
            yield head, tensor
        elif held_by_stage(root, name):
            yield name, tensor
