"""CLIP's (and SigLIP's) vision transformer, as a LLaVA-style model's image encoder: plain
PyTorch.

Why not the token-wise machinery: an image is one bidirectional sequence of a fixed length
(one row per patch, plus the class token), encoded once and never extended, so it needs no
paged KV cache, no attention metadata and no forward context. A batch of images is one
`[images, patches, hidden]` tensor run through `scaled_dot_product_attention`.

Only the layers the language model reads are built: LLaVA takes the hidden states after
layer `vision_feature_layer` (-2 by default: the last layer is never used), so the layers
after the deepest one asked for, and the final `post_layernorm`, are left out and their
checkpoint tensors skipped (`CLIPVisionTower.skips`).

SigLIP's tower is the same transformer with other embeddings (the patch convolution has a
bias, there is no class token) and no `pre_layrnorm`; its pooling `head` is never used here.
Gemma 3 reads SigLIP's `last_hidden_state`, which is after `post_layernorm`
(`post_layernorm=True`: every layer and the final norm are built).

Names follow the checkpoint (`embeddings.patch_embedding`, `pre_layrnorm` with HF's spelling,
`encoder.layers.N.self_attn.q_proj`, ...), so weights load by name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation: a sigmoid approximation of GELU (x * sigmoid(1.702 x))."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def activation(name: str) -> Any:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class CLIPVisionEmbeddings(nn.Module):
    """Patches by a strided convolution (no bias), a learned class token, learned positions."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.patch_size = int(cfg.patch_size)
        self.image_size = int(cfg.image_size)
        hidden = int(cfg.hidden_size)
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(
            int(cfg.num_channels), hidden, self.patch_size, self.patch_size, bias=False
        )
        self.num_positions = (self.image_size // self.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(self.num_positions, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        check_image_size(pixel_values, self.image_size)
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class SiglipVisionEmbeddings(nn.Module):
    """Patches by a strided convolution (with a bias) plus learned positions; no class token."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.patch_size = int(cfg.patch_size)
        self.image_size = int(cfg.image_size)
        hidden = int(cfg.hidden_size)
        self.patch_embedding = nn.Conv2d(
            int(cfg.num_channels), hidden, self.patch_size, self.patch_size
        )
        self.num_positions = (self.image_size // self.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_positions, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        check_image_size(pixel_values, self.image_size)
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


def check_image_size(pixel_values: torch.Tensor, image_size: int) -> None:
    size = tuple(pixel_values.shape[-2:])
    if size != (image_size, image_size):
        raise ValueError(
            f"the vision tower takes {image_size}x{image_size} images, got "
            f"{size[0]}x{size[1]} pixel values (the image processor resizes and crops to it)"
        )


class CLIPAttention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        hidden = int(cfg.hidden_size)
        self.num_heads = int(cfg.num_attention_heads)
        self.head_dim = hidden // self.num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class CLIPEncoderLayer(nn.Module):
    """Pre-norm: x + attn(ln1(x)), then x + fc2(act(fc1(ln2(x))))."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        hidden, eps = int(cfg.hidden_size), float(cfg.layer_norm_eps)
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = CLIPAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(hidden, int(cfg.intermediate_size))
        self.mlp.fc2 = nn.Linear(int(cfg.intermediate_size), hidden)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


# The vision towers a LLaVA config may name, by `vision_config.model_type`.
TOWER_TYPES = ("clip_vision_model", "siglip_vision_model")


class CLIPVisionTower(nn.Module):
    """Pixels `[images, channels, size, size]` -> the hidden states of the chosen layers.

    `feature_layers` index HF's `hidden_states` tuple (entry 0: the embeddings, after
    `pre_layrnorm` for CLIP; entry i: after encoder layer i), negative from its end as in HF.
    """

    def __init__(self, cfg: Any, feature_layers: list[int], post_layernorm: bool = False) -> None:
        super().__init__()
        model_type = getattr(cfg, "model_type", "clip_vision_model")
        if model_type not in TOWER_TYPES:
            raise ValueError(
                f"unsupported vision tower {model_type!r}; supported: {', '.join(TOWER_TYPES)}"
            )
        num_layers = int(cfg.num_hidden_layers)
        self.feature_layers = [i % (num_layers + 1) for i in feature_layers]
        self.num_built = max(self.feature_layers)
        if post_layernorm and self.feature_layers != [num_layers]:
            raise ValueError("post_layernorm applies to the last layer's output only")
        self.post_layernorm: nn.Module | None = None
        if post_layernorm:
            self.post_layernorm = nn.LayerNorm(int(cfg.hidden_size), eps=float(cfg.layer_norm_eps))
        self.siglip = model_type == "siglip_vision_model"
        if self.siglip:
            self.embeddings: nn.Module = SiglipVisionEmbeddings(cfg)
            self.pre_layrnorm: nn.Module = nn.Identity()
        else:
            self.embeddings = CLIPVisionEmbeddings(cfg)
            self.pre_layrnorm = nn.LayerNorm(int(cfg.hidden_size), eps=float(cfg.layer_norm_eps))
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(CLIPEncoderLayer(cfg) for _ in range(self.num_built))

    @property
    def seq_len(self) -> int:
        """Rows per image: one per patch, plus CLIP's class token."""
        return self.embeddings.num_positions

    def skips(self, name: str) -> bool:
        """Whether a checkpoint tensor (name relative to the tower) belongs to a part not
        built: layers after the deepest feature layer, `post_layernorm`, SigLIP's pooling
        `head`, or HF's `position_ids` buffer (a plain arange, saved by older transformers)."""
        if name.startswith("post_layernorm."):
            return self.post_layernorm is None
        if name.startswith("head.") or name.endswith("position_ids"):
            return True
        if name.startswith("encoder.layers."):
            return int(name.split(".")[2]) >= self.num_built
        return False

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The chosen layers' hidden states, concatenated on the feature axis."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        if self.post_layernorm is not None:
            return self.post_layernorm(x)
        return torch.cat([states[i] for i in self.feature_layers], dim=-1)
