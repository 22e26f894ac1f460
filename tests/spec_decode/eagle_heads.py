"""Tiny EAGLE heads in the published checkpoint layouts, and a target they can copy.

`eagle1_head` writes what SafeAILab's EAGLE training code saves (a Llama config.json with one
layer, `fc.weight` + `fc.bias`, `layers.0.*` including the unused input norm, a copy of the
target's embedding); `eagle3_head` what EAGLE-3 checkpoints hold (`LlamaForCausalLMEagle3`,
`draft_vocab_size`, `fc` over three layers, `midlayer.*` with `hidden_norm`, `norm`, `lm_head`
over the draft vocabulary, `d2t` and `t2d`). Random heads propose almost nothing right; the
"copy" heads are built by hand to propose what `counting_target` emits.

`counting_target` is a real Llama checkpoint whose greedy continuation of token t is t + 1:
its attention and MLP outputs are zero, so the residual stream at every layer is the token's
embedding (random unit vectors), and its LM head row v is the embedding of v - 1, whose
largest inner product with embedding t is at v = t + 1.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from tests.tiny_checkpoints import build_tiny_checkpoint


def _target_config(target: str) -> LlamaConfig:
    return LlamaConfig.from_pretrained(target)


def _head_config(target: str, **overrides: Any) -> LlamaConfig:
    t = _target_config(target)
    fields: dict[str, Any] = {
        "hidden_size": t.hidden_size,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": t.vocab_size,
        "max_position_embeddings": t.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "architectures": ["LlamaForCausalLM"],
    }
    fields.update(overrides)
    return LlamaConfig(**fields)


def _layer(prefix: str, cfg: LlamaConfig, gen: torch.Generator, qkv_in: int) -> dict[str, Any]:
    h, hd = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
    q, kv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2

    return {
        f"{prefix}.self_attn.q_proj.weight": rand(q, qkv_in),
        f"{prefix}.self_attn.k_proj.weight": rand(kv, qkv_in),
        f"{prefix}.self_attn.v_proj.weight": rand(kv, qkv_in),
        f"{prefix}.self_attn.o_proj.weight": rand(h, q),
        f"{prefix}.mlp.gate_proj.weight": rand(inter, h),
        f"{prefix}.mlp.up_proj.weight": rand(inter, h),
        f"{prefix}.mlp.down_proj.weight": rand(h, inter),
        f"{prefix}.input_layernorm.weight": 1 + rand(h) / 2,
        f"{prefix}.post_attention_layernorm.weight": 1 + rand(h) / 2,
    }


def _save(out: str, cfg: LlamaConfig, weights: dict[str, torch.Tensor]) -> str:
    os.makedirs(out, exist_ok=True)
    cfg.save_pretrained(out)
    tensors = {k: v.contiguous() for k, v in weights.items()}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def _target_weights(target: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(target, "model.safetensors"))


def eagle1_head(out: str, target: str, seed: int = 0, copy: bool = False, **cfg: Any) -> str:
    """An EAGLE-1 head for `target`; `copy`: fc passes the token embedding through and the
    layer adds nothing, so the target's LM head predicts what follows that token."""
    config = _head_config(target, **cfg)
    gen = torch.Generator().manual_seed(seed)
    h = config.hidden_size
    w = _layer("layers.0", config, gen, h)
    w["fc.weight"] = torch.randn(h, 2 * h, generator=gen) * 0.1
    w["fc.bias"] = torch.randn(h, generator=gen) * 0.1
    w["embed_tokens.weight"] = _target_weights(target)["model.embed_tokens.weight"]
    if copy:
        w["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        w["fc.bias"] = torch.zeros(h)
        w["layers.0.self_attn.o_proj.weight"].zero_()
        w["layers.0.mlp.down_proj.weight"].zero_()
    return _save(out, config, w)


def eagle3_head(
    out: str,
    target: str,
    seed: int = 0,
    drop: int = 8,
    copy: bool = False,
    with_d2t: bool = True,
    **cfg: Any,
) -> str:
    """An EAGLE-3 head for `target` whose draft vocabulary leaves out `drop` target tokens.
    `copy`: fc keeps the first layer's input (the token's embedding, in `counting_target`),
    the midlayer adds nothing, and the LM head scores draft id d by the embedding of
    target(d) - 2: the token two after the one at the position."""
    t = _target_config(target)
    vocab = t.vocab_size
    keep = sorted(set(range(vocab)) - set(range(5, 5 + 2 * drop, 2)))
    config = _head_config(
        target, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=len(keep), **cfg
    )
    gen = torch.Generator().manual_seed(seed)
    h = config.hidden_size
    w = _layer("midlayer", config, gen, 2 * h)
    w["midlayer.hidden_norm.weight"] = 1 + torch.randn(h, generator=gen) * 0.1
    w["norm.weight"] = 1 + torch.randn(h, generator=gen) * 0.1
    w["fc.weight"] = torch.randn(h, 3 * t.hidden_size, generator=gen) * 0.1
    w["lm_head.weight"] = torch.randn(len(keep), h, generator=gen) * 0.2
    ids = torch.tensor(keep, dtype=torch.int64)
    if with_d2t:
        w["d2t"] = ids - torch.arange(len(keep))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    w["t2d"] = t2d
    if copy:
        embed = _target_weights(target)["model.embed_tokens.weight"]
        w["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, 2 * h)], dim=1)
        w["midlayer.self_attn.o_proj.weight"].zero_()
        w["midlayer.mlp.down_proj.weight"].zero_()
        w["norm.weight"] = torch.ones(h)
        w["lm_head.weight"] = embed[(ids - 2) % vocab]
    return _save(out, config, w)


def counting_target(out: str, num_hidden_layers: int = 8) -> str:
    """A Llama checkpoint whose greedy next token after t is t + 1 (see the module doc)."""
    path = build_tiny_checkpoint(out, num_hidden_layers=num_hidden_layers)
    weights = _target_weights(path)
    gen = torch.Generator().manual_seed(7)
    embed = torch.randn(weights["model.embed_tokens.weight"].shape, generator=gen)
    embed = embed / embed.norm(dim=-1, keepdim=True)
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = torch.roll(embed, 1, dims=0)  # row v = embedding of v - 1
    weights["model.norm.weight"] = torch.ones(embed.shape[1])
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path
