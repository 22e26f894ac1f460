"""Loading a model with `FusedMoE` layers: routing expert tensors, strictly, per rank.

Checkpoints store experts in one of two forms, both accepted:

- one tensor per expert and projection (`...experts.3.w1.weight` in Mixtral,
  `...experts.3.gate_proj.weight` in Qwen-MoE): what `save_pretrained` writes, also in
  transformers 5, which converts back to this form when saving;
- transformers 5's in-memory form, stacked over experts: `...experts.gate_up_proj`
  `[E, 2*I, H]` (gate rows, then up rows) and `...experts.down_proj` `[E, H, I]`.

Expert tensors go to the owning layer's `weight_loader`; everything else goes through
`load_stacked_weights` as for dense models. Loading stays strict: a missing expert tensor is
named as the checkpoint would name it, while a tensor of an expert that another DP rank holds
is skipped, since it is not missing but simply not this rank's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from tokenwise.layers.fused_moe.layer import FusedMoE
from tokenwise.layers.weight_utils import StackedMapping, checkpoint_names, load_stacked_weights

# (FusedMoE parameter, checkpoint name relative to the experts module, expert id, shard id);
# expert id None marks a tensor stacked over all experts.
ExpertMapping = list[tuple[str, str, int | None, str]]


def make_expert_params_mapping(
    num_experts: int, gate_proj: str, up_proj: str, down_proj: str
) -> ExpertMapping:
    """The expert tensors of a checkpoint whose per-expert projections have these names."""
    mapping: ExpertMapping = []
    for e in range(num_experts):
        mapping += [
            ("w13_weight", f"{e}.{gate_proj}.weight", e, "w1"),
            ("w13_weight", f"{e}.{up_proj}.weight", e, "w3"),
            ("w2_weight", f"{e}.{down_proj}.weight", e, "w2"),
        ]
    mapping += [("w13_weight", "gate_up_proj", None, "w13"), ("w2_weight", "down_proj", None, "w2")]
    return mapping


def _rename(name: str, renames: Mapping[str, str]) -> str:
    return ".".join(renames.get(part, part) for part in name.split("."))


def load_weights_with_experts(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_mapping: StackedMapping,
    expert_mapping: ExpertMapping,
    renames: Mapping[str, str] | None = None,
) -> set[str]:
    """Load `weights` into `model`; returns the parameters filled completely.

    `renames` maps checkpoint module names to the model's (Mixtral's `block_sparse_moe` is
    `mlp` here, as in transformers 5); error messages use the checkpoint's names.
    """
    renames = dict(renames or {})
    back = {v: k for k, v in renames.items()}
    layers = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
    by_ckpt = {ckpt: (param, expert, shard) for param, ckpt, expert, shard in expert_mapping}
    seen: dict[str, set[tuple[int | None, str]]] = {name: set() for name in layers}

    current = ["", ""]  # (model name, checkpoint name) of the tensor being loaded

    def dense() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            current[:] = [_rename(name, renames), name]
            hit = _expert_target(current[0], layers, by_ckpt)
            if hit is None:
                yield current[0], tensor
                continue
            layer_name, param_name, expert, shard = hit
            layer = layers[layer_name]
            try:
                if layer.weight_loader(getattr(layer, param_name), tensor, shard, expert):
                    seen[layer_name].add((expert, shard))
            except ValueError as e:
                raise ValueError(f"cannot load checkpoint tensor {name!r}: {e}") from e

    try:
        loaded = load_stacked_weights(model, dense(), stacked_mapping)
    except ValueError as e:
        # load_stacked_weights saw the renamed tensor; name it as the checkpoint does.
        renamed, original = current
        if renamed == original:
            raise
        raise ValueError(str(e).replace(repr(renamed), repr(original))) from e
    missing: list[str] = []
    for layer_name, layer in layers.items():
        for param, gaps in _gaps(layer, seen[layer_name], expert_mapping).items():
            missing += [_rename(_join(layer_name, ckpt), back) for ckpt in gaps]
            if not gaps:
                loaded.add(_join(layer_name, param))
    for name, _ in model.named_parameters():
        if name not in loaded and name.rpartition(".")[0] not in layers:
            missing += [_rename(n, back) for n in checkpoint_names(name, stacked_mapping).values()]
    if missing:
        raise ValueError(
            f"checkpoint for {type(model).__name__} is missing tensors: {', '.join(sorted(missing))}"
        )
    return loaded


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _expert_target(
    name: str, layers: Mapping[str, FusedMoE], by_ckpt: Mapping[str, tuple[str, int | None, str]]
) -> tuple[str, str, int | None, str] | None:
    """(layer, parameter, expert id, shard id) for an expert tensor's name, else None."""
    parts = name.split(".")
    for tail in (3, 1):  # "<e>.<proj>.weight", or "gate_up_proj" / "down_proj"
        head, rel = ".".join(parts[:-tail]), ".".join(parts[-tail:])
        if rel in by_ckpt and head in layers:
            return (head, *by_ckpt[rel])
    return None


# The stacked shard that covers each parameter whole.
_STACKED_SHARD = {"w13_weight": "w13", "w2_weight": "w2"}


def _gaps(
    layer: FusedMoE, seen: set[tuple[int | None, str]], mapping: ExpertMapping
) -> dict[str, list[str]]:
    """Per parameter, the checkpoint names (relative to the layer) still missing.

    A parameter is complete when its stacked tensor came, or the per-expert tensors of every
    expert this rank holds. Gaps are named in the checkpoint's form: stacked names once a
    stacked tensor was seen in this layer, per-expert names otherwise.
    """
    stacked_form = any(expert is None for expert, _ in seen)
    shard = layer.shard
    local = range(shard.first_expert, shard.first_expert + shard.num_local_experts)
    gaps: dict[str, list[str]] = {}
    for param, stacked_shard in _STACKED_SHARD.items():
        entries = [(ckpt, e, s) for p, ckpt, e, s in mapping if p == param]
        missing: list[str] = []
        if (None, stacked_shard) not in seen:
            missing = [
                c for c, e, s in entries if e is not None and e in local and (e, s) not in seen
            ]
            if missing and stacked_form:
                missing = [c for c, e, _ in entries if e is None]
        gaps[param] = missing
    return gaps
