"""Build a model for an `EngineConfig` and fill its weights from safetensors, a GGUF file
(`tokenwise.gguf`) or dummy values, then quantize its linear layers when `quantization` says so
(`tokenwise.layers.quantization`: int8 / int4 on load, a GGUF file's own bit widths, a GPTQ,
AWQ or compressed-tensors checkpoint's own integers, `prequantized`, or FP8: an "fp8"
checkpoint's own weights and block scales, or fp8 on load, `fp8_loading`).

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
import logging
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
from tokenwise.layers.quantization import awq, compressed_tensors, fp8_loading, gptq
from tokenwise.layers.quantization.gguf_layers import GGUFLayerQuantizer, expert_checkpoint_names
from tokenwise.layers.quantization.gpu_selfcheck import prepare_model
from tokenwise.layers.quantization.prequantized import PrequantizedCheckpoint
from tokenwise.layers.quantization.schemes import (
    INT4,
    INT8,
    on_load_scheme,
    quantize_experts,
    quantize_model,
)
from tokenwise.layers.weight_utils import (
    CheckpointTensor,
    LazyTensor,
    StackedMapping,
    checkpoint_names,
)
from tokenwise.model_config import ModelConfig
from tokenwise.models.registry import resolve_model_class
from tokenwise.quantization_config import (
    CPU_METHODS,
    FP8,
    PREQUANTIZED,
    checkpoint_quantization_config,
    fp8_checkpoint_config,
    int_checkpoint_config,
    keeps_integers,
)

logger = logging.getLogger(__name__)

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
    gguf_layers: GGUFLayerQuantizer | None = None
    prequantized: PrequantizedCheckpoint | None = None
    fp8: fp8_loading.FP8Checkpoint | None = None
    on_cpu = torch.device(device).type == "cpu"
    keep_ints = keeps_integers(model_config.quantization, str(torch.device(device)))
    with _build_in(model_config.dtype, torch.device(device)):
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
        if model_config.quantization in PREQUANTIZED:
            # The format's tensors become dense weights here; their integers are kept aside.
            # Quantized layers' tensors are read whole; under TP each rank then keeps its slice
            # of their integers (`tp_slice`). CPU and CUDA layers compute with them (`_quantize`).
            keep_fp8 = not on_cpu or fp8_loading.keep_fp8_on_cpu()
            prequantized = _prequantized_reader(model, model_config, keep_ints, keep_fp8)
            weights = prequantized.wrap(weights, safetensors_names(files))
        qc = checkpoint_quantization_config(model_config.hf_config)
        if model_config.quantization == FP8 and qc is not None:
            # fp8 weights and their block scales become dense weights here, the fp8 kept aside.
            keep = not on_cpu or fp8_loading.keep_fp8_on_cpu()
            fp8 = fp8_loading.FP8Checkpoint(model, fp8_checkpoint_config(qc), keep)
            weights = fp8.wrap(weights, safetensors_names(files))
        loaded = model.load_weights(weights)
        _check_complete(model, loaded)
        apply_kv_scales(model, kv_scales, config.cache.cache_dtype.startswith("fp8"))
    elif model_config.load_format == "gguf":
        # Dequantized on load, then (CPU, CUDA) quantized again with the file's bit widths.
        expected = _expected_checkpoint_names(model)
        gguf_layers = GGUFLayerQuantizer(model, keep_exact=keep_ints)
        weights = iterate_gguf(
            model_config.model, expected, model_config.dtype, gguf_layers.observe
        )
        loaded = model.load_weights(weights)
        _check_complete(model, loaded)
    else:
        raise ValueError(f"unknown load_format {model_config.load_format!r}")
    if fp8 is not None:
        fp8_loading.install(model, fp8.record_for, keep_fp8=fp8.keep)
    elif model_config.quantization == FP8:
        fp8_loading.quantize_on_load(model, keep_fp8=not on_cpu or fp8_loading.keep_fp8_on_cpu())
    else:
        _quantize(model, model_config.quantization, keep_ints, on_cpu, gguf_layers or prequantized)
        if keep_ints and not on_cpu:  # integers onto the device, each layer's route chosen
            prepare_model(model, torch.device(device), model_config.dtype)
    if prequantized is not None and prequantized.fp8_records:  # compressed-tensors FP8 layers
        fp8_loading.install(model, prequantized.fp8_record_for, keep_fp8=True)
    return model.eval().requires_grad_(False)


def _prequantized_reader(
    model: nn.Module, model_config: ModelConfig, keep_exact: bool, keep_fp8: bool
) -> PrequantizedCheckpoint:
    """The reader of a GPTQ, AWQ or compressed-tensors checkpoint's quantized layers."""
    method = model_config.quantization
    qc = checkpoint_quantization_config(model_config.hf_config) or {}
    if method == "compressed-tensors":
        return compressed_tensors.reader(model, qc, keep_exact, keep_fp8)
    config = int_checkpoint_config(str(method), qc)
    fmt = gptq if method == "gptq" else awq
    convert = functools.partial(fmt.convert, config)
    return PrequantizedCheckpoint(model, fmt.SUFFIXES, fmt.MARKER, convert, keep_exact)


def _quantize(
    model: nn.Module,
    method: str | None,
    keep_ints: bool,
    on_cpu: bool,
    recorded: GGUFLayerQuantizer | PrequantizedCheckpoint | None,
) -> None:
    """Apply `quantization` (`tokenwise.layers.quantization.schemes`) to the loaded model: on
    load (int8, int4), or with the file's own integers (GGUF and quantized checkpoints, kept
    where `keeps_integers` says: elsewhere they stay dequantized to the model's dtype). Routed
    experts are quantized on the CPU only: elsewhere they stay in the model's dtype, as their
    quantized path runs one expert at a time outside the MoE op that graphs capture."""
    if method in CPU_METHODS:
        scheme = INT8 if method == "int8" else INT4
        quantize_model(model, on_load_scheme(scheme))
        if on_cpu:
            quantize_experts(model, scheme)
    elif keep_ints and recorded is not None:
        quantize_model(model, recorded.scheme_for, recorded.exact)
        if isinstance(recorded, GGUFLayerQuantizer) and on_cpu:
            recorded.quantize_experts(model)
    if not on_cpu and keep_ints and any(hasattr(m, "quant_experts") for m in model.modules()):
        logger.info("routed experts stay in the model's dtype off the CPU (not quantized)")


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
