"""Copying checkpoint tensors into parameters: the part of weight loading that models call.

A model's `load_weights` routes each Hugging Face tensor to a parameter (or to one shard of a
fused parameter) through `load_stacked_weights`; the layers' `weight_loader`s do the copies with
`copy_checked`. These helpers live here, next to the layers and below the models, rather than
in `tokenwise.loader`: the loader resolves the model class, so it sits *above* the models, and
a model importing it would close an import circle.

Loading is strict. A checkpoint tensor the model does not know, a parameter the checkpoint does
not provide and a shape mismatch are all errors that name the tensors involved, because a
silently half-loaded model produces plausible-looking garbage that is far harder to debug.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

# (fused parameter component, checkpoint component, shard id), e.g. ("qkv_proj", "q_proj", "q").
StackedMapping = Sequence[tuple[str, str, str | int]]


def copy_checked(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy `loaded` into `param` (casting dtype and device), refusing to broadcast.

    `Tensor.copy_` would happily broadcast a `[1, n]` tensor into `[m, n]`, hiding a wrong
    checkpoint, so shapes are compared explicitly.
    """
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"shape mismatch: the model expects {tuple(param.shape)}, "
            f"the checkpoint has {tuple(loaded.shape)}"
        )
    with torch.no_grad():
        param.copy_(loaded)


def default_weight_loader(
    param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
) -> None:
    """The loader of a parameter that is not fused: a checked whole-tensor copy."""
    if shard_id is not None:
        raise ValueError(f"this parameter is not fused; got shard id {shard_id!r}")
    copy_checked(param, loaded_weight)


def _map_name(name: str, mapping: StackedMapping) -> tuple[str, str | int | None]:
    parts = name.split(".")
    for fused, ckpt, shard in mapping:
        if ckpt in parts:
            return ".".join(fused if p == ckpt else p for p in parts), shard
    return name, None


def checkpoint_names(param_name: str, mapping: StackedMapping) -> dict[str | int | None, str]:
    """The checkpoint tensor behind each shard of a parameter (itself when not fused)."""
    parts = param_name.split(".")
    names = {
        shard: ".".join(ckpt if p == fused else p for p in parts)
        for fused, ckpt, shard in mapping
        if fused in parts
    }
    return names or {None: param_name}


def load_stacked_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], mapping: StackedMapping
) -> set[str]:
    """Copy checkpoint tensors into `model`, routing the ones in `mapping` to fused shards.

    Returns the parameters that were filled completely: a fused one only when all its shards
    arrived, so a checkpoint lacking just `k_proj` is caught as a missing tensor.
    """
    params = dict(model.named_parameters())
    shards_seen: dict[str, set[str | int | None]] = {}
    for name, tensor in weights:
        target, shard = _map_name(name, mapping)
        param = params.get(target)
        if param is None:
            raise ValueError(
                f"checkpoint tensor {name!r} does not match any parameter of {type(model).__name__}"
            )
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"cannot load checkpoint tensor {name!r} into {target!r}: {e}") from e
        shards_seen.setdefault(target, set()).add(shard)
    loaded: set[str] = set()
    partial: list[str] = []
    for target, seen in shards_seen.items():
        needed = checkpoint_names(target, mapping)
        partial += [ckpt for shard, ckpt in needed.items() if shard not in seen]
        if seen >= needed.keys():
            loaded.add(target)
    if partial:
        raise ValueError(
            f"checkpoint for {type(model).__name__} is missing tensors: {', '.join(sorted(partial))}"
        )
    return loaded
