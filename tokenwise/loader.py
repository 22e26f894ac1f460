"""Build a model for an `EngineConfig` and fill its weights from safetensors, a GGUF file
(`tokenwise.gguf`) or dummy values, then give its layers their quantization methods when
`quantization` says so. Which method is one look-up (`layers.quantization.registry`); its
`QuantizationConfig` reads the format while the checkpoint streams by (`wrap_weights`,
`gguf_observer`) and installs the methods after loading (`process_model`): this module knows
no method by name.

Parameters are created directly in the target dtype and device (by making those the defaults
while the model is constructed), so a bf16 model on a GPU never exists as an fp32 CPU copy.
Checkpoint tensors are then streamed one at a time from `safe_open`, which memory-maps the
files: peak extra memory is one tensor, not one checkpoint. Under tensor parallelism the tensors
are handed over unread (`LazyTensor`), and each rank reads only the slices it holds.

Loading is strict. A checkpoint tensor the model does not know, a parameter the checkpoint does
not provide and a shape mismatch are all errors that name the tensors involved, because a
silently half-loaded model produces plausible-looking garbage that is far harder to debug.

This module sits above the models (it picks the class from the registry); the copy helpers the
models themselves call are in `tokenwise.layers.weight_utils`, below them.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from safetensors import safe_open
from torch import nn

from tokenwise.attention.kv_scales import apply_kv_scales, take_kv_scales
from tokenwise.config import EngineConfig
from tokenwise.distributed.tp_state import get_tp_size
from tokenwise.gguf.weights import iterate_gguf
from tokenwise.layers.quantization.base_config import building_with
from tokenwise.layers.quantization.gguf_layers import expert_checkpoint_names
from tokenwise.layers.quantization.registry import get_quantization_config
from tokenwise.layers.weight_utils import (
    CheckpointTensor,
    LazyTensor,
    StackedMapping,
    checkpoint_names,
)
from tokenwise.models.registry import resolve_model_class

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's safetensors files: the shards named by the index, or the single file."""
    index_path = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [os.path.join(model_dir, shard) for shard in sorted(set(weight_map.values()))]
        absent = [path for path in files if not os.path.isfile(path)]
        if absent:
            raise FileNotFoundError(f"{SAFETENSORS_INDEX} names shards that do not exist: {absent}")
        return files
    single = os.path.join(model_dir, SAFETENSORS_SINGLE)
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(
        f"no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} in {model_dir!r} (tokenwise reads "
        "safetensors checkpoints only; use load_format='dummy' for random weights)"
    )


def iterate_safetensors(
    files: Iterable[str], lazy: bool = False
) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yield `(name, tensor)` one tensor at a time, so only one is ever resident.

    `lazy=True` (tensor parallelism) yields `LazyTensor`s instead: each weight loader reads
    only this rank's slice, so no rank materialises a whole sharded tensor. A lazy tensor must
    be used before the iteration moves on (its file is closed after the last one).
    """
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if lazy:
                    read_full = functools.partial(f.get_tensor, name)
                    yield name, LazyTensor(f.get_slice(name), read_full)
                else:
                    yield name, f.get_tensor(name)


def safetensors_names(files: Iterable[str]) -> set[str]:
    """Every tensor name in the files (their headers only)."""
    names: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Deterministic stand-in weights: N(0, 0.02) matrices, unit norm weights, zero biases.

    Values are drawn on the CPU in fp32 from one generator, in parameter order, so they are the
    same for any device and dtype; no file is read.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1:
            param.fill_(1.0)
        else:
            values = torch.empty(param.shape, dtype=torch.float32)
            param.copy_(values.normal_(0.0, 0.02, generator=generator))


@contextmanager
def _build_in(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Make `torch.empty` & co. create tensors in `dtype` on `device` for the duration."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(previous)


def load_model(config: EngineConfig, device: str | torch.device = "cpu") -> nn.Module:
    """Instantiate `config.model`'s architecture and load its weights; eval mode, no grads."""
    model_config = config.model
    if model_config is None:
        raise ValueError("load_model needs config.model (a tokenwise.model_config.ModelConfig)")
    model_cls = resolve_model_class(model_config.architectures)
    config_cls = get_quantization_config(model_config.quantization)
    quant_config = config_cls.from_model_config(model_config, torch.device(device))
    with _build_in(model_config.dtype, torch.device(device)), building_with(quant_config):
        model = model_cls(config)
    if model_config.load_format == "dummy":
        init_dummy_weights(model, model_config.seed)
    elif model_config.load_format in ("auto", "safetensors"):
        # Under TP every rank reads only its slices of the checkpoint tensors.
        lazy = get_tp_size() > 1
        files = safetensors_files(model_config.model)
        weights = iterate_safetensors(files, lazy=lazy)
        kv_scales: dict[str, float] = {}  # fp8 KV-cache scales, not weights of the model
        weights = take_kv_scales(weights, kv_scales)
        # A quantized format's tensors become the dense weights the model loads.
        weights = quant_config.wrap_weights(model, weights, lambda: safetensors_names(files))
        loaded = model.load_weights(weights)
        _check_complete(model, loaded)
        apply_kv_scales(model, kv_scales, config.cache.cache_dtype.startswith("fp8"))
    elif model_config.load_format == "gguf":
        # Dequantized on load; the method may keep the file's own integers (`gguf_observer`).
        expected = _expected_checkpoint_names(model)
        observe = quant_config.gguf_observer(model)
        weights = iterate_gguf(model_config.model, expected, model_config.dtype, observe)
        loaded = model.load_weights(weights)
        _check_complete(model, loaded)
    else:
        raise ValueError(f"unknown load_format {model_config.load_format!r}")
    quant_config.process_model(model)  # each layer's method (`layers.quantization`)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return model.eval().requires_grad_(False)


def _expected_checkpoint_names(model: nn.Module) -> list[str]:
    """The checkpoint (HF) names of every parameter, fused ones split into their parts, and
    one name per expert and projection for MoE experts."""
    mapping: StackedMapping = getattr(model, "stacked_params_mapping", ())
    names: list[str] = []
    for name, _ in model.named_parameters():
        names.extend(checkpoint_names(name, mapping).values())
    for experts in expert_checkpoint_names(model).values():
        names.extend(n for expert in experts for n in expert)
    return names


def _check_complete(model: nn.Module, loaded: set[str]) -> None:
    mapping: StackedMapping = getattr(model, "stacked_params_mapping", ())
    missing: set[str] = set()
    for name, _ in model.named_parameters():
        if name not in loaded:
            missing.update(checkpoint_names(name, mapping).values())
    if missing:
        raise ValueError(
            f"checkpoint for {type(model).__name__} is missing tensors: {', '.join(sorted(missing))}"
        )


def quantized_layer_names(model: nn.Module) -> list[str]:
    """The layers whose weights a quantization method holds in its own format (their plain
    `weight` is on the meta device): new values cannot be copied into them by name."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.device.type == "meta"
    ]


def load_weights_in_place(
    model: nn.Module, weights: Iterable[tuple[str, CheckpointTensor]]
) -> set[str]:
    """Copy new values (HF names, full tensors or lazy slices) into a loaded model's
    parameters, in place: their addresses stay, so graphs and kernels that hold them see the
    new values. Quantized layers are refused by name. Returns the parameters filled."""
    quantized = quantized_layer_names(model)
    if quantized:
        shown = ", ".join(quantized[:4]) + (", ..." if len(quantized) > 4 else "")
        raise ValueError(
            f"weight updates into quantized layers are not supported ({len(quantized)} "
            f"layers: {shown}); serve the model unquantized to update its weights"
        )
    with torch.no_grad():
        return model.load_weights(take_kv_scales(weights, {}))


def reload_weights_from(model: nn.Module, path: str) -> int:
    """Load a whole safetensors checkpoint directory into a loaded model, in place (every
    parameter must be in it); returns the number of parameters filled."""
    files = safetensors_files(path)
    loaded = load_weights_in_place(model, iterate_safetensors(files, lazy=get_tp_size() > 1))
    _check_complete(model, loaded)
    return len(loaded)
