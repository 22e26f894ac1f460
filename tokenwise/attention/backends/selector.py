"""Choose the attention backend for a device.

The portable `torch` backend (plain PyTorch ops) is used on CPU and is the fallback on GPU.
"""

from __future__ import annotations

from typing import Any

from tokenwise.attention.backends.torch_backend import TorchAttentionBackend


def get_attn_backend(config: Any | None = None) -> type[TorchAttentionBackend]:
    return TorchAttentionBackend
