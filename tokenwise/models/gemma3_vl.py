"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): a SigLIP tower, Gemma 3's
projector, the Gemma 3 text model.

An image becomes `mm_tokens_per_image` rows of the decoder's embedding space: SigLIP's last
hidden state (after its `post_layernorm`), one row per patch, average-pooled from the
`patches x patches` grid down to `sqrt(mm_tokens_per_image)` per side, RMS-normed (Gemma's
`1 + weight` norm) and projected by one matrix (`mm_input_projection_weight`, no bias). The
processor writes `<start_of_image>`, that many soft image tokens (`image_token_index`), then
`<end_of_image>`; the image rows replace the soft tokens' embeddings (the text embeddings are
scaled by `sqrt(hidden_size)`, the image rows are not, as in HF).

What Gemma 3 adds over LLaVA is in attention: the soft tokens of one image attend to each
other bidirectionally (causal OR same image; in sliding layers, AND the window). The model
says so (`bidirectional_image_attention`); the multimodal runner puts each prefill's image
spans on the step's attention metadata and the backend widens the mask for them. That is
exact only if an image's tokens are computed in one chunk (a query cannot see keys a later
chunk computes), so the scheduler never ends a chunk inside such an image (vLLM's
`disable_chunked_mm_input`; `MultiModalScheduler`).

Checkpoint layouts: transformers 4.x wrote `vision_tower.vision_model.*`,
`multi_modal_projector.*`, `language_model.model.*`; 5.x writes `model.vision_tower.*`,
`model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.*` (and 5.x's
`save_pretrained` writes the 4.x names again, with `vision_tower.*` for the tower): LLaVA's
`checkpoint_name` maps them all.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.layers.layernorm import GemmaRMSNorm
from tokenwise.layers.pipeline import IntermediateTensors, StageAbsent
from tokenwise.models.clip_vision import CLIPVisionTower
from tokenwise.models.gemma3 import Gemma3ForCausalLM
from tokenwise.models.image_merge import decode_with_images
from tokenwise.models.llava import (
    IMAGE_MODULES,
    checkpoint_name,
    copy_tower_tensor,
    image_token_id,
)


class Gemma3Projector(nn.Module):
    """SigLIP rows `[images, patches^2, vision hidden]` -> `[images, tokens, text hidden]`."""

    def __init__(self, vision: Any, text_hidden: int, tokens_per_image: int) -> None:
        super().__init__()
        hidden = int(vision.hidden_size)
        self.patches_per_side = int(vision.image_size) // int(vision.patch_size)
        self.tokens_per_side = int(round(tokens_per_image**0.5))
        if (
            self.tokens_per_side**2 != tokens_per_image
            or self.patches_per_side % self.tokens_per_side
        ):
            raise ValueError(
                f"mm_tokens_per_image={tokens_per_image} must be a square whose side divides "
                f"the {self.patches_per_side} patches per side of the vision tower"
            )
        self.kernel = self.patches_per_side // self.tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.empty(hidden, text_hidden))
        self.mm_soft_emb_norm = GemmaRMSNorm(hidden, float(vision.layer_norm_eps))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        n, _, hidden = rows.shape
        side = self.patches_per_side
        grid = rows.transpose(1, 2).reshape(n, hidden, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    is_multimodal = True
    # Under pipeline parallelism the first stage holds the vision tower and embeds the images;
    # later stages get the image spans (both-ways attention) in the step message.
    supports_pp = True
    # Soft tokens of one image attend to each other both ways (see the module docstring).
    bidirectional_image_attention = True

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        mm = config.model.hf_multimodal_config
        if mm is None:
            raise ValueError("Gemma3ForConditionalGeneration needs a config with vision_config")
        super().__init__(config, prefix)
        vision = mm.vision_config
        self.image_token_index = int(image_token_id(mm))
        self.vocab_size = int(config.model.hf_config.vocab_size)
        self.tokens_per_image = int(mm.mm_tokens_per_image)
        self.vision_tower: nn.Module = StageAbsent()
        self.multi_modal_projector: nn.Module = StageAbsent()
        if self.model.is_first_stage:
            self.vision_tower = CLIPVisionTower(vision, [-1], post_layernorm=True)
            if not self.vision_tower.siglip:
                raise ValueError("Gemma 3's vision tower must be SigLIP (siglip_vision_model)")
            hidden = int(config.model.hf_config.hidden_size)
            self.multi_modal_projector = Gemma3Projector(vision, hidden, self.tokens_per_image)

    @property
    def num_image_tokens(self) -> int:
        """Soft tokens (embedding rows) per image: `mm_tokens_per_image`."""
        return self.tokens_per_image

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`[images, 3, size, size]` -> `[images, mm_tokens_per_image, hidden]`."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

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
        later pipeline stage starts from `intermediate_tensors`."""
        if intermediate_tensors is not None:
            return self.model(input_ids, positions, intermediate_tensors=intermediate_tensors)
        return decode_with_images(
            self.model, input_ids, positions, image_embeds, image_token_rows, self._embed_text
        )

    def _embed_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Real checkpoints put the soft token past the text vocabulary (HF embeds it as 0);
        # its embedding is overwritten either way.
        return self.model.embed(input_ids.masked_fill(input_ids >= self.vocab_size, 0))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder's tensors through Gemma's loader (fused q/k/v and gate/up, tied head);
        the tower's and projector's copied by name."""
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
                if name.startswith("vision_tower.") and self.vision_tower.skips(
                    name[len("vision_tower.") :]
                ):
                    continue
                loaded.add(copy_tower_tensor(params, name, tensor, "Gemma 3"))

        return super().load_weights(text_weights()) | loaded
