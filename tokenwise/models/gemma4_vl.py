"""Gemma 4 with images (`Gemma4ForConditionalGeneration`, the hub's checkpoints): the vision
tower (`gemma4_vision.py`), its embedder (`embed_vision`) and the Gemma 4 text model.

The processor writes `<|image>`, one soft token (`image_token_id`) per pooled square of
patches (the count follows the image's aspect ratio: `gemma4_image_inputs.py`), then
`<image|>`; the tower's rows replace the soft tokens' embeddings, unscaled (the text
embeddings are scaled by `sqrt(hidden_size)`). As in HF, every multimodal placeholder (image,
video, audio) is read as the pad token by the text embedding and by the per-layer embeddings
(PLE) of the E2B/E4B models; the PLE's projection of the main embedding sees the image rows.

Attention over images differs from Gemma 3's. With `use_bidirectional_attention="vision"`
(the larger hub models) the soft tokens of one image attend to each other both ways in the
sliding layers only (causal OR same image, AND the window); global layers stay causal. The
model names those layers (`bidirectional_image_layers`), the multimodal runner puts the image
spans on their KV-cache groups' metadata alone, and the scheduler never ends a chunk inside an
image. Without it (None: the small models), every layer is causal and a chunk may cut an
image.

With `limit_mm_per_prompt={"image": 0}` the checkpoint is served as its text model: no tower is
built, its tensors are skipped, and the engine runs it as `Gemma4ForCausalLM` (tensor and data
parallelism included). Audio (`Gemma4AudioModel`) and video are not served: their towers' tensors are skipped, and
a prompt with audio is refused by the multimodal kind, which reads images only. Under
pipeline parallelism the first stage holds the tower; the step message carries the image
spans, and each stage sets them on its own sliding layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.layers.pipeline import IntermediateTensors, StageAbsent
from tokenwise.models.gemma2 import SLIDING, gemma_layer_types
from tokenwise.models.gemma4 import Gemma4ForCausalLM
from tokenwise.models.gemma4_vision import Gemma4MultimodalEmbedder, Gemma4VisionTower
from tokenwise.models.image_merge import decode_with_images, images_turned_off
from tokenwise.models.llava import copy_tower_tensor

# The towers and embedders of the modalities that are not served: their tensors are skipped.
SKIPPED = ("model.audio_tower.", "model.embed_audio.")
IMAGE_PREFIXES = {"model.vision_tower.": "vision_tower.", "model.embed_vision.": "embed_vision."}


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    is_multimodal = True
    # Image pixels arrive as each image's own patch grid (see `gemma4_image_inputs.py`).
    variable_image_tokens = True
    # Under pipeline parallelism the first stage holds the tower and embeds the images; every
    # stage puts the image spans on its own sliding layers (`bidirectional_image_layers`).
    supports_pp = True
    # `limit_mm_per_prompt={"image": 0}` serves the checkpoint as its text model (no tower;
    # tensor and data parallelism as `Gemma4ForCausalLM`), as vLLM's language-model-only mode.
    text_only_without_images = True

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        mm = config.model.hf_multimodal_config
        if mm is None:
            raise ValueError("Gemma4ForConditionalGeneration needs a config with vision_config")
        super().__init__(config, prefix)
        hf = config.model.hf_config
        vision = mm.vision_config
        self.pad_token_id = int(getattr(hf, "pad_token_id", None) or 0)
        placeholders = [getattr(mm, f"{m}_token_id", None) for m in ("image", "video", "audio")]
        self.register_buffer(
            "placeholder_ids",
            torch.tensor([int(t) for t in placeholders if t is not None]),
            persistent=False,
        )
        self.vision_tower: nn.Module = StageAbsent()
        self.embed_vision: nn.Module = StageAbsent()
        if self.model.is_first_stage and not images_turned_off(config.model.limit_mm_per_prompt):
            self.vision_tower = Gemma4VisionTower(vision)
            self.embed_vision = Gemma4MultimodalEmbedder(
                int(vision.hidden_size), int(hf.hidden_size), float(vision.rms_norm_eps)
            )
        # Image tokens attend both ways in the sliding layers ("vision"), else causally.
        self.bidirectional_image_attention = (
            getattr(hf, "use_bidirectional_attention", None) == "vision"
        )
        # This stage's sliding layers; a KV-sharing layer attends through its producer's
        # `attn` (same type, same spans).
        kinds = gemma_layer_types(hf)
        self.bidirectional_image_layers = frozenset(
            self.model.layers[i].self_attn.attn.layer_name
            for i in range(self.model.start_layer, self.model.end_layer)
            if kinds[i] == SLIDING and not self.model.kv_shared[i]
        )

    @property
    def num_image_tokens(self) -> int:
        """Not fixed: each image has its own count (the prompt side computes it)."""
        return 0

    def embed_image_list(
        self, pixel_values: list[torch.Tensor], grids: list[Any]
    ) -> list[torch.Tensor]:
        """The runner's entry: each image's `[rows * cols, 3 * patch^2]` patches and its
        `(1, rows, cols)` grid -> its `[rows * cols / k^2, hidden]` rows."""
        rows = self.vision_tower(torch.cat(pixel_values), [tuple(g) for g in grids])
        return [self.embed_vision(r) for r in rows]

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
        ids = input_ids.masked_fill(torch.isin(input_ids, self.placeholder_ids), self.pad_token_id)
        return decode_with_images(
            self.model, ids, positions, image_embeds, image_token_rows, self.model.embed
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder's tensors through Gemma 4's loader; the tower's and embedder's (with
        their clip bounds and standardization buffers) copied by name."""
        own = dict(self.named_parameters()) | dict(self.named_buffers())
        loaded: set[str] = set()

        def text_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(SKIPPED):
                    continue
                image = next((p for p in IMAGE_PREFIXES if name.startswith(p)), None)
                if image is None:
                    yield name.replace("model.language_model.", "model.", 1), tensor
                    continue
                if isinstance(self.vision_tower, StageAbsent):
                    continue  # the first stage's, and only when images are served
                ours = IMAGE_PREFIXES[image] + name[len(image) :]
                loaded.add(copy_tower_tensor(own, ours, tensor, "Gemma 4's tower"))

        return super().load_weights(text_weights()) | loaded
