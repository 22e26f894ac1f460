"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a windowed ViT and a Qwen2 decoder with
M-RoPE.

As LLaVA, this class *is* the text model (Qwen2) plus the vision tower
(`qwen2_5_vl_vision.py`), and a `forward` that writes image rows over the placeholder tokens
(`image_token_id`; `grid_image_model.py`, shared with Qwen3.5). What differs from LLaVA:

- an image has as many placeholder tokens as its size asks for (`grid_thw`: one token per
  2x2 patches), so the vision tower takes a list of images of different sizes;
- the decoder's rotary embedding is M-RoPE (`layers/mrope.py`): `positions` may be
  `[3, num_tokens]` (temporal, height, width). The engine computes each prompt's 3-D
  positions once (`engine/kinds/mrope_positions.py`) and the runner feeds each step's
  columns; a model given 1-D positions (no runner support) rotates as plain Qwen2.

Checkpoint layouts: transformers 4.x (before 4.52) wrote `visual.*`, `model.*`, `lm_head.*`;
later ones write `model.visual.*`, `model.language_model.*`, `lm_head.*`. `checkpoint_name`
maps both onto this module's names.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.layers.mrope import MRotaryEmbedding, get_mrope_section
from tokenwise.layers.pipeline import StageAbsent
from tokenwise.layers.rotary_embedding import get_rope_config
from tokenwise.models.grid_image_model import GridImageModel
from tokenwise.models.llava import image_token_id
from tokenwise.models.qwen2 import Qwen2ForCausalLM
from tokenwise.models.qwen2_5_vl_vision import Qwen2_5_VisionTower


def checkpoint_name(name: str) -> str:
    """This model's name for a checkpoint tensor of either transformers layout."""
    if name.startswith("model.visual."):
        return name[len("model.") :]
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


class Qwen2_5_VLForConditionalGeneration(GridImageModel, Qwen2ForCausalLM):
    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        mm = config.model.hf_multimodal_config
        if mm is None:
            raise ValueError("Qwen2_5_VLForConditionalGeneration needs a config with vision_config")
        hf = config.model.hf_config
        if getattr(mm, "tie_word_embeddings", False):  # 5.x keeps it on the outer config
            hf.tie_word_embeddings = True
        super().__init__(config, prefix)
        section = get_mrope_section(hf)
        if section is None:
            raise ValueError("a Qwen2.5-VL text config needs rope_parameters['mrope_section']")
        theta, scaling = get_rope_config(hf)
        mc = config.model
        rotary = MRotaryEmbedding(mc.head_dim, mc.max_model_len, theta, section, scaling)
        self.use_rotary(rotary)
        self.image_token_index = int(image_token_id(mm))
        # Under pipeline parallelism the images are the first stage's (it embeds the prompt);
        # every stage gets the step's 3-D positions in the step message.
        self.visual: nn.Module = StageAbsent()
        if self.model.is_first_stage:
            self.visual = Qwen2_5_VisionTower(mm.vision_config)
        self.spatial_merge_size = int(mm.vision_config.spatial_merge_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder's tensors through Qwen2's loader (fusing q/k/v and gate/up); the vision
        tower's copied by name (the patch embedding's Conv3d kernel flattened)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def text_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = checkpoint_name(name)
                if not name.startswith("visual."):
                    yield name, tensor
                    continue
                if not self.model.is_first_stage:
                    continue  # another pipeline stage's
                if name not in params:
                    raise ValueError(
                        f"checkpoint tensor {name!r} matches no parameter of Qwen2.5-VL"
                    )
                if name == "visual.patch_embed.proj.weight":
                    tensor = tensor.reshape(tensor.shape[0], -1)
                if tuple(params[name].shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the "
                        f"model expects {tuple(params[name].shape)}"
                    )
                params[name].data.copy_(tensor)
                loaded.add(name)

        return super().load_weights(text_weights()) | loaded
