"""Read a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`).

An adapter adds `scaling * B @ A` to some linear layers: `A [r, in]`, `B [out, r]`, and
`scaling = lora_alpha / r` (or `/ sqrt(r)` with rsLoRA). Everything is checked here, when the
adapter is first asked for, so a bad adapter fails its request with an error naming the file
and the setting, never a shape error in the middle of a step. Variants that change the maths
(DoRA, per-module ranks, trained biases, extra trained modules) are refused by name rather than
served wrongly.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIX = "base_model.model."


@dataclass
class PeftAdapter:
    """One adapter, parsed: for each targeted HF module name, its `(A, B)` pair."""

    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _read_config(path: str) -> dict:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {path!r} has no {CONFIG_FILE} (not a PEFT adapter dir)")
    with open(config_path) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {path!r} is a {config['peft_type']} adapter, not LORA")
    refused = {
        "use_dora": "DoRA adapters",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "modules_to_save": "extra trained modules (modules_to_save)",
        "lora_bias": "trained LoRA biases (lora_bias)",
        "fan_in_fan_out": "fan_in_fan_out weights",
    }
    for key, what in refused.items():
        if config.get(key):
            raise ValueError(f"adapter {path!r}: {what} are not supported ({key}={config[key]!r})")
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter {path!r}: bias={config['bias']!r} is not supported (need none)")
    return config


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            if name.endswith(".safetensors"):
                return load_file(file)
            return torch.load(file, map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {path!r} has no weights ({' or '.join(WEIGHT_FILES)})")


def load_peft_adapter(path: str, max_lora_rank: int) -> PeftAdapter:
    """Parse and check the adapter at `path`; its rank must not exceed `max_lora_rank`."""
    config = _read_config(path)
    rank = int(config["r"])
    if rank > max_lora_rank:
        raise ValueError(
            f"adapter {path!r} has rank {rank}, above max_lora_rank={max_lora_rank}; "
            "start the engine with a larger max_lora_rank"
        )
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_weights(path).items():
        name = key.removeprefix(_PREFIX)
        module, _, kind = name.rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ValueError(
                f"adapter {path!r}: tensor {key!r} is not a LoRA A/B weight "
                "(embedding and other adapter kinds are not supported)"
            )
        pairs.setdefault(module, {})[kind[0]] = tensor
    weights = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {path!r}: module {module!r} lacks lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(
                f"adapter {path!r}: {module!r} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                f"not [r, in] and [out, r] with r={rank}"
            )
        weights[module] = (a, b)
    if not weights:
        raise ValueError(f"adapter {path!r} holds no LoRA weights")
    return PeftAdapter(path=path, rank=rank, scaling=scaling, weights=weights)
