"""The model a runner executes: loaded, then made ready for its device and its settings.

Order matters and is kept here, once: oneDNN prepacking of the linear weights is for the eager
CPU path only (Inductor cannot lower oneDNN's packed linear over our weights, and lays out its
own matmuls anyway); the weights then move to huge pages (decode streams them: no TLB miss per
4 KB page); adapter slots go into the linear layers before compilation sees the model; and
`torch.compile` wraps the result last.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenwise.compilation.compile import PieceWrapper, compile_model
from tokenwise.config import EngineConfig
from tokenwise.layers.cpu_prepack import prepack_linear_weights
from tokenwise.layers.huge_pages import move_weights_to_huge_pages
from tokenwise.loader import load_model
from tokenwise.lora.manager import LoRAManager


def load_prepared_model(
    config: EngineConfig, device: torch.device, max_num_tokens: int, wrap_piece: PieceWrapper | None
) -> tuple[nn.Module, LoRAManager | None]:
    """The loaded model, prepared as above, and its LoRA manager (None without LoRA).
    `max_num_tokens` sizes the adapters' per-token buffers; `wrap_piece` is the graph
    mode's wrapper for compiled pieces (`graph_setup`)."""
    model = load_model(config, device)
    if device.type == "cpu" and not config.compilation.use_compile:
        prepack_linear_weights(model)
    if device.type == "cpu":
        move_weights_to_huge_pages(model)
    lora_manager = None
    if config.lora is not None:
        assert config.model is not None
        lora_manager = LoRAManager(model, config.lora, max_num_tokens, config.model.dtype, device)
    if config.compilation.use_compile:
        model = compile_model(model, config.compilation, wrap_piece)
    return model, lora_manager
