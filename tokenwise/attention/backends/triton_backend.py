"""GPU attention: SDPA per prefill, a Triton paged-decode kernel, graph-safe throughout decode.

Cache layout of one layer: `[2, num_blocks + 1, block_size, num_kv_heads, head_size]` (K then
V). Token-major blocks make the K/V write one `index_copy_` over flat slots (no Python loop, no
host sync), and the decode kernel still reads whole rows of `head_size` contiguous elements per
token and head, which is what coalesced loads want. The extra last block is the trash block that
PAD slots (padding rows, `PAD_SLOT_ID`) are written to, so no write ever needs a mask.

Prefill and K/V writes are the torch backend's (`TorchAttentionImpl`): one
`scaled_dot_product_attention` per prompt (chunk), `is_causal=True` for a fresh prompt and a
lower-right causal bias after cached context, so both stay eligible for SDPA's flash kernel on
a GPU; only sliding windows need an explicit mask.

Decode: `triton_paged_decode.paged_decode` on CUDA with Triton, else the PyTorch reference
`paged_decode_reference` (same inputs, same semantics; also what tests compare the kernel with).
Both read only device tensors (`slot_mapping`, `seq_lens_tensor`, `block_tables`), so a decode
step can be captured whole in a CUDA graph and replayed on fresh metadata copied into the same
buffers (`supports_full_cudagraph`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, partial
from typing import TYPE_CHECKING

import torch

from tokenwise.attention.backends.torch_backend import TorchAttentionBackend, TorchAttentionImpl

if TYPE_CHECKING:
    from tokenwise.attention.metadata import AttentionMetadata


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether Triton can be imported (it is never a dependency of tokenwise)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class TritonAttentionImpl(TorchAttentionImpl):
    """The torch backend's prefill and cache writes; decode always graph-safe, by Triton on CUDA."""

    def _decode_into(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        output.copy_(self._decode(q, key_cache, value_cache, md))

    def _decode_step_cpu(self, *args: object) -> None:
        """Never the torch backend's one-call CPU step: forced onto a CPU (tests), this
        backend keeps its own decode, the one its CUDA graphs capture."""
        return None

    def _paged_decode_fn(self, q: torch.Tensor) -> Callable[..., torch.Tensor]:
        # The kernel has no soft-cap: capped layers (Gemma 2) decode through the reference.
        if q.is_cuda and triton_available() and not self.logits_soft_cap:
            from tokenwise.attention.backends.triton_paged_decode import paged_decode

            return paged_decode if self.sinks is None else partial(paged_decode, sinks=self.sinks)
        return super()._paged_decode_fn(q)


class TritonAttentionBackend(TorchAttentionBackend):
    """Same cache layout as the torch backend; only the decode kernel differs."""

    name = "triton"
    supports_full_cudagraph = True

    @staticmethod
    def get_impl_cls() -> type[TritonAttentionImpl]:
        return TritonAttentionImpl
