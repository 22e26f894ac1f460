"""Tiny DeepSeek-V3 checkpoints carrying an MTP module, as DeepSeek ships them.

transformers neither builds nor saves the MTP module, so it is appended here to a tiny
`DeepseekV3ForCausalLM` checkpoint as the layer after the last one, `model.layers.{L}.*`:
`enorm`, `hnorm`, `eh_proj`, a full decoder layer (a copy of layer L - 1's tensors, with noise:
MLA attention and the MoE), `shared_head.norm`, `shared_head.head` and its own `embed_tokens`.
transformers still loads the checkpoint (it ignores those tensors), so HF's greedy output
stays the reference.

`counting=True` also turns the target into one whose greedy token after t is t + 1 (every
attention and feed-forward output zero, unit embeddings, LM head row v = embedding of v - 1)
and the MTP module into one that copies: `eh_proj` keeps the normed embedding of the next
token, the layer adds nothing, and the shared head is the target's.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from tests.tiny_checkpoints import build_tiny_checkpoint

ARCH = "DeepseekV3ForCausalLM"


def deepseek_with_mtp(out: str, counting: bool = False, seed: int = 0, layers: int = 3) -> str:
    path = build_tiny_checkpoint(out, ARCH, seed=seed, num_hidden_layers=layers)
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    gen = torch.Generator().manual_seed(seed + 11)
    embed = weights["model.embed_tokens.weight"]
    vocab, h = embed.shape
    if counting:
        embed = torch.randn(embed.shape, generator=gen)
        embed = embed / embed.norm(dim=-1, keepdim=True)
        weights["model.embed_tokens.weight"] = embed
        weights["lm_head.weight"] = torch.roll(embed, 1, dims=0)
        weights["model.norm.weight"] = torch.ones(h)
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    for name, tensor in list(weights.items()):
        if name.startswith(last):
            noise = 0.1 * tensor.std() * torch.randn(tensor.shape, generator=gen)
            weights[mtp + name[len(last) :]] = (
                tensor + noise if tensor.dim() > 1 else tensor.clone()
            )
    weights[mtp + "enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    weights[mtp + "hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    weights[mtp + "eh_proj.weight"] = 0.2 * torch.randn(h, 2 * h, generator=gen)
    weights[mtp + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    weights[mtp + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    weights[mtp + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    if counting:
        for name, tensor in weights.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensor.zero_()
        weights[mtp + "enorm.weight"] = torch.ones(h)
        weights[mtp + "shared_head.norm.weight"] = torch.ones(h)
        weights[mtp + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    save_file(weights, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def without_mtp_layers(path: str) -> str:
    """The same checkpoint saying it has no MTP module."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = 0
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path
