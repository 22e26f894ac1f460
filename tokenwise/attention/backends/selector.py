"""Choose the attention backend for a device.

- `triton` on a CUDA device when Triton can be imported: SDPA prefill, a Triton paged-decode
  kernel, and a decode that can be captured whole in a CUDA graph.
- `torch` otherwise: plain PyTorch ops, the CPU backend and the GPU fallback.

`TOKENWISE_ATTENTION_BACKEND=torch|triton` overrides the choice. Forcing `triton` on a CPU runs
its PyTorch reference decode in place of the kernel (same layout and graph-safety, which is how
tests exercise full-graph replay without a GPU).
"""

from __future__ import annotations

from typing import Any

from tokenwise import envs
from tokenwise.attention.backends.torch_backend import TorchAttentionBackend
from tokenwise.attention.backends.triton_backend import TritonAttentionBackend, triton_available

BACKENDS: dict[str, Any] = {"torch": TorchAttentionBackend, "triton": TritonAttentionBackend}
ENV_VAR = "TOKENWISE_ATTENTION_BACKEND"


def backend_name_for(device: str) -> str:
    """The backend a device gets: the override, else triton on CUDA with Triton, else torch."""
    forced = envs.get(ENV_VAR).strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(
                f"{ENV_VAR} must be one of {', '.join(BACKENDS)}, got {envs.get(ENV_VAR)!r}"
            )
        return forced
    if str(device).startswith("cuda") and triton_available():
        return "triton"
    return "torch"


def get_attn_backend(config: Any | None = None) -> Any:
    """The backend class for `config.device` (torch when there is no config)."""
    device = getattr(config, "device", "cpu") if config is not None else "cpu"
    return BACKENDS[backend_name_for(device)]
