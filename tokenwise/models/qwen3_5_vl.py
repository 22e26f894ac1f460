"""Qwen3.5 with its vision tower (`Qwen3_5ForConditionalGeneration`, and the MoE twin).

The decoder is the text model's (`qwen3_5.py`: the Gated DeltaNet hybrid, read from
`model.language_model.*`); the tower is `qwen3_5_vision.py` (`model.visual.*`). Images take
Qwen2.5-VL's path through the engine unchanged: the same processor and placeholder expansion
(`engine/kinds/grid_image_inputs.py`), the same 3-D prompt positions
(`engine/kinds/mrope_positions.py`, HF's `get_rope_index`: an image's tokens sit at
`start + (frame, row, column)` and the text after it resumes at `start + max(rows, cols)`),
and image rows written over the placeholders' embeddings (`image_merge.py`). Videos go the same
way: each temporal group of two frames, behind its timestamp, is placed and embedded as an
image of one frame (`engine/kinds/video_prompts.py`).

Two things differ from Qwen2.5-VL:

- the M-RoPE of the full-attention layers turns only the first `partial_rotary_factor` of each
  head, and its frequencies take the three axes *interleaved* (`layers/mrope.py`), not in
  three bands; HF's default `mrope_section` is [11, 11, 10];
- the linear-attention layers carry recurrent state, which ignores positions. Images cost them
  nothing special: their state snapshots, and so prefix-cache hits, are at block boundaries,
  whose keys cover the images' content hashes as for any vision-language model.

With `limit_mm_per_prompt={"image": 0}` (vLLM's "language model only") the checkpoint serves
text alone, as the text model: no tower, the generate kind, and so tensor / data parallelism
and speculative decoding (the MTP head), which vision-language models do not take yet.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.layers.mrope import MRotaryEmbedding, get_mrope_section
from tokenwise.layers.pipeline import StageAbsent
from tokenwise.layers.rotary_embedding import get_rope_config
from tokenwise.models.grid_image_model import GridImageModel
from tokenwise.models.image_merge import images_turned_off
from tokenwise.models.llava import image_token_id
from tokenwise.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from tokenwise.models.qwen3_5_vision import Qwen3_5VisionTower

_TEXT_PREFIXES = (("model.language_model.", "model."),)
_VISUAL = "model.visual."
DEFAULT_MROPE_SECTION = [11, 11, 10]  # HF's default when the config names none


def interleaved_mrope(hf: Any, rotary_dim: int, max_len: int) -> MRotaryEmbedding:
    theta, scaling = get_rope_config(hf)
    if scaling is not None:
        for key in ("partial_rotary_factor", "mrope_section", "mrope_interleaved"):
            scaling.pop(key, None)
    section = get_mrope_section(hf) or DEFAULT_MROPE_SECTION
    return MRotaryEmbedding(rotary_dim, max_len, theta, section, scaling, interleaved=True)


class Qwen3_5VisionLanguage(GridImageModel):
    """What both Qwen3.5 vision-language classes add to their text model (a mixin placed
    before it): the tower, the 3-D rotary, image rows in `forward`, the tower's weights."""

    # `limit_mm_per_prompt={"image": 0}` serves the checkpoint as its text model (image_merge.py)
    text_only_without_images = True
    text_prefixes = _TEXT_PREFIXES

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        mm = config.model.hf_multimodal_config
        if mm is None:
            raise ValueError(f"{type(self).__name__} needs a config with vision_config")
        super().__init__(config, prefix)  # type: ignore[call-arg]
        rotary = interleaved_mrope(
            config.model.hf_config, self.model.rotary_emb.head_dim, config.model.max_model_len
        )
        self.use_rotary(rotary)
        self.image_token_index = int(image_token_id(mm))
        # Under pipeline parallelism the images are the first stage's (it embeds the prompt);
        # with images turned off no stage builds the tower (its tensors are skipped).
        self.visual: nn.Module = StageAbsent()
        if self.model.is_first_stage and not images_turned_off(config.model.limit_mm_per_prompt):
            self.visual = Qwen3_5VisionTower(mm.vision_config)
        self.spatial_merge_size = int(mm.vision_config.spatial_merge_size)
        # Videos (`engine/kinds/video_prompts.py`): each temporal group of frames is placed
        # and embedded as an image, between these markers.
        self.video_pad_token_id = int(mm.video_token_id)
        self.video_start_token_id = int(mm.vision_start_token_id)
        self.video_end_token_id = int(mm.vision_end_token_id)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """All tensors through the text model's loader (which checks names, shapes and that
        none is missing): the tower's as `visual.*`, its patch embedding's Conv3d kernel
        flattened; a later pipeline stage skips them (it holds no tower)."""

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(_VISUAL):
                    name = "visual." + name[len(_VISUAL) :]
                    if name == "visual.patch_embed.proj.weight":
                        tensor = tensor.reshape(tensor.shape[0], -1)
                yield name, tensor

        return super().load_weights(renamed())  # type: ignore[misc]


class Qwen3_5ForConditionalGeneration(Qwen3_5VisionLanguage, Qwen3_5ForCausalLM):
    pass


class Qwen3_5MoeForConditionalGeneration(Qwen3_5VisionLanguage, Qwen3_5MoeForCausalLM):
    pass
