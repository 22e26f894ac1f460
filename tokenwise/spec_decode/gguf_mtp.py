"""The MTP head of a Qwen3.5 / Qwen3-Next GGUF file, loaded for speculative method "mtp".

The head is the module a checkpoint directory's `mtp.*` tensors load into
(`models.qwen3_next_mtp.Qwen3NextMTPHead`); only where its tensors come from differs: the
file's first block after the decoder (`gguf.mtp_tensors` names them, `gguf.weights` reads
them back to the checkpoint's values). It is loaded as the target's file is
(`loader.load_model`'s GGUF branch): under the file's quantization method, each tensor observed
before the cast, so a Q8_0 head keeps the file's integers in its linear layers exactly as the
target's do, then each layer gets its method.

A file converted without the head (`--no-mtp`, or an older converter) is refused here, naming
the option and the file, before any weight is read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.gguf.hf_config import gguf_architecture
from tokenwise.gguf.hybrid_config import GDN_ARCHS
from tokenwise.gguf.mtp_tensors import MTP_PREFIX, nextn_layers
from tokenwise.gguf.reader import read_metadata
from tokenwise.gguf.weights import iterate_gguf
from tokenwise.layers.quantization.base_config import building_with
from tokenwise.layers.quantization.registry import get_quantization_config
from tokenwise.loader import _build_in, _check_complete, _expected_checkpoint_names
from tokenwise.models.qwen3_next import Qwen3NextForCausalLM
from tokenwise.models.qwen3_next_mtp import Qwen3NextMTPHead

Observer = Callable[[str, torch.Tensor, str, np.ndarray], None]


def check_gguf_mtp(path: str, target_model: nn.Module) -> str:
    """The file's architecture, once it is known to hold an MTP head tokenwise runs; else a
    `ValueError` naming `speculative_config.method` and the file."""
    metadata, _ = read_metadata(path)
    arch = gguf_architecture(metadata, path)
    if arch not in GDN_ARCHS or not isinstance(target_model, Qwen3NextForCausalLM):
        raise ValueError(
            "speculative_config.method 'mtp' runs the MTP head of Qwen3.5, Qwen3.5-MoE and "
            f"Qwen3-Next GGUF files ({', '.join(GDN_ARCHS)}); GGUF file {path!r} is a "
            f"{arch!r} model"
        )
    if nextn_layers(metadata, arch) < 1:
        raise ValueError(
            f"speculative_config.method 'mtp' needs an MTP head, and GGUF file {path!r} has "
            f"none ({arch}.nextn_predict_layers is 0 or absent: it was converted without "
            "the head, e.g. with --no-mtp); convert the checkpoint again keeping it, or "
            "choose another speculative_config.method"
        )
    return arch


def load_gguf_mtp_head(
    config: EngineConfig, target_model: nn.Module, device: torch.device
) -> nn.Module:
    """The head of `config.model.model` (a GGUF file), its layers quantized as the file's
    tensor types say; eval mode, no grads."""
    mc = config.model
    path = mc.model
    check_gguf_mtp(path, target_model)
    quant_config = get_quantization_config(mc.quantization).from_model_config(mc, device)
    with _build_in(mc.dtype, device), building_with(quant_config):
        head = Qwen3NextMTPHead(config, target_model)
    expected = [MTP_PREFIX + name for name in _expected_checkpoint_names(head)]
    observe = _unprefixed(quant_config.gguf_observer(head))
    weights = iterate_gguf(path, expected, mc.dtype, observe, mtp=True)
    try:
        _check_complete(head, head.load_weights(weights))
    except ValueError as exc:
        raise ValueError(f"speculative_config.method 'mtp', GGUF file {path!r}: {exc}") from exc
    quant_config.process_model(head)
    for module in head.modules():
        method: Any = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return head.eval().requires_grad_(False)


def _unprefixed(observe: Observer) -> Observer:
    """The quantizer knows the head's parameters by their own names (`layers.0...`), the
    file's tensors come as the checkpoint's (`mtp.layers.0...`)."""

    def seen(name: str, values: torch.Tensor, type_name: str, raw: np.ndarray) -> None:
        observe(name.removeprefix(MTP_PREFIX), values, type_name, raw)

    return seen


__all__ = ["check_gguf_mtp", "load_gguf_mtp_head"]
