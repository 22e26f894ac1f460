"""LLaVA (`LlavaForConditionalGeneration`): a CLIP (or SigLIP) vision tower, a projector, a
Llama decoder.

An image becomes `num_image_tokens` rows of the decoder's embedding space: the vision tower's
hidden states of `vision_feature_layer` (one row per patch, plus the class token, which the
"default" `vision_feature_select_strategy` drops and "full" keeps), through the projector
(linear, GELU, linear). The prompt holds that many placeholder tokens (`image_token_index`)
where the image goes; the decoder reads the image rows there instead of the placeholder's
embedding, and is otherwise the text model unchanged: this class *is* the text model
(`LlamaForCausalLM`, or Mistral / Qwen2 by the text config's `model_type`) plus the two image
modules and a `forward` that takes merged embeddings.

The runner decides which image rows a step needs (a chunked prefill may stop inside an
image): `embed_images` runs the tower for whole images, `forward` gets the rows of this
step's placeholder tokens and their indices in the flat token stream.

Checkpoint layouts: transformers 4.x wrote `vision_tower.vision_model.*`,
`multi_modal_projector.*` and `language_model.model.*` / `language_model.lm_head.*`; 5.x
writes `model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*` and
`lm_head.*` (and saves some files in the 4.x names again). `checkpoint_name` maps all of them
onto this module's names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.layers.pipeline import IntermediateTensors, StageAbsent
from tokenwise.models.clip_vision import CLIPVisionTower, activation
from tokenwise.models.image_merge import decode_with_images
from tokenwise.models.llama import DecoderVariant, LlamaForCausalLM
from tokenwise.models.qwen2 import Qwen2ForCausalLM

# The text models a LLaVA checkpoint may wrap, by their config's `model_type`.
TEXT_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,  # Mistral's decoder is Llama's (its window is in the config)
    "qwen2": Qwen2ForCausalLM,
}


def checkpoint_name(name: str) -> str:
    """This model's name for a checkpoint tensor of either transformers layout."""
    for prefix in ("model.vision_tower.", "model.multi_modal_projector.", "model.language_model."):
        if name.startswith(prefix):
            name = name[len("model.") :]
            break
    if name.startswith("vision_tower.vision_model."):
        return "vision_tower." + name[len("vision_tower.vision_model.") :]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model.") :]
    if name.startswith("language_model.model."):
        return "model." + name[len("language_model.model.") :]
    if name.startswith("language_model."):
        return "model." + name[len("language_model.") :]
    return name


# Parameters loaded by name, outside the text model's fused-weight mapping.
IMAGE_MODULES = ("vision_tower.", "multi_modal_projector.")


class LlavaProjector(nn.Module):
    """Vision features -> the decoder's hidden size: linear_1, activation, linear_2."""

    def __init__(self, in_features: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden, bias=bias)
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    is_multimodal = True

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        mm = config.model.hf_multimodal_config
        if mm is None:
            raise ValueError("LlavaForConditionalGeneration needs a config with vision_config")
        text_type = getattr(config.model.hf_config, "model_type", "llama")
        if text_type not in TEXT_MODELS:
            raise ValueError(
                f"LLaVA with a {text_type!r} text model is not supported; supported: "
                f"{sorted(TEXT_MODELS)}"
            )
        self._text_cls = TEXT_MODELS[text_type]
        super().__init__(config, prefix)
        vision = mm.vision_config
        layers = mm.vision_feature_layer
        layers = [int(layers)] if isinstance(layers, int) else [int(i) for i in layers]
        self.select_strategy = str(mm.vision_feature_select_strategy)
        if self.select_strategy not in ("default", "full"):
            raise ValueError(
                f"vision_feature_select_strategy must be 'default' or 'full', got "
                f"{self.select_strategy!r}"
            )
        self.image_token_index = int(image_token_id(mm))
        # Under pipeline parallelism the images are the first stage's: it embeds the prompt.
        self.vision_tower: nn.Module = StageAbsent()
        self.multi_modal_projector: nn.Module = StageAbsent()
        if self.model.is_first_stage:
            self.vision_tower = CLIPVisionTower(vision, layers)
            self.multi_modal_projector = LlavaProjector(
                int(vision.hidden_size) * len(layers),
                int(config.model.hf_config.hidden_size),
                str(getattr(mm, "projector_hidden_act", "gelu")),
                bool(getattr(mm, "multimodal_projector_bias", True)),
            )

    def decoder_variant(self, hf_config: Any) -> DecoderVariant:  # type: ignore[override]
        return self._text_cls.decoder_variant(hf_config)

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens (embedding rows) per image: the tower's rows, less the first
        under the "default" strategy (CLIP's class token; HF drops it for SigLIP too)."""
        return self.vision_tower.seq_len - (self.select_strategy == "default")

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`[images, 3, size, size]` -> `[images, num_image_tokens, hidden]`."""
        features = self.vision_tower(pixel_values)
        if self.select_strategy == "default":
            features = features[:, 1:]  # CLIP's class token is not an image row
        return self.multi_modal_projector(features)

    def embed_image_list(self, pixel_values: list[torch.Tensor], grids: list[Any]) -> torch.Tensor:
        """The runner's entry: images of one size, so they stack (`grids` are unused)."""
        return self.embed_images(torch.stack(pixel_values))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        image_embeds: torch.Tensor | None = None,
        image_token_rows: torch.Tensor | None = None,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """`image_embeds[i]` replaces the embedding of flat token `image_token_rows[i]`; a
        later pipeline stage starts from `intermediate_tensors` instead (no images there)."""
        if intermediate_tensors is not None:
            return self.model(input_ids, positions, intermediate_tensors=intermediate_tensors)
        return decode_with_images(self.model, input_ids, positions, image_embeds, image_token_rows)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder's tensors through the text model's loader (which fuses q/k/v and
        gate/up); the vision tower's and projector's copied by name, unfused."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def text_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = checkpoint_name(name)
                if not name.startswith(IMAGE_MODULES):
                    yield name, tensor
                    continue
                if not self.model.is_first_stage:
                    continue  # another pipeline stage's
                if self.vision_tower.skips(name[len("vision_tower.") :]):
                    continue
                loaded.add(copy_tower_tensor(params, name, tensor, "LLaVA"))

        return super().load_weights(text_weights()) | loaded


def copy_tower_tensor(
    targets: dict[str, torch.Tensor], name: str, tensor: torch.Tensor, family: str
) -> str:
    """Copy a vision tower's (or projector's) checkpoint tensor into the parameter or buffer
    of that name, refusing by name one that matches none or has another shape; returns the
    name. Towers load unfused, so a plain copy is all they need."""
    if name not in targets:
        raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {family}")
    if tuple(targets[name].shape) != tuple(tensor.shape):
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
            f"{tuple(targets[name].shape)}"
        )
    targets[name].data.copy_(tensor)
    return name


def image_token_id(mm_config: Any) -> int:
    """The placeholder token's id (`image_token_index` in 4.x configs, `image_token_id` in
    some 5.x ones)."""
    for name in ("image_token_index", "image_token_id"):
        value = getattr(mm_config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError("the model's config names no image token (image_token_index)")
