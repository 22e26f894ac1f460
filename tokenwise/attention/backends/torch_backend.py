"""Paged attention in plain PyTorch: the CPU backend and the GPU fallback.

Layout of one layer's cache: `[2, num_blocks + 1, block_size, num_kv_heads, head_size]`
(K then V, token-major blocks, which beat head-major on CPU). The extra last block is a trash
block: PAD slots are redirected there, so padding writes need no mask, no host sync and never
touch a block the block manager hands out.

Prefill: one `scaled_dot_product_attention` per sequence (the fastest formulation on CPU);
with cached context the keys come from the cache and the causal mask is aligned bottom-right.
Decode on CPU: a small C kernel (`tokenwise/native/paged_decode.c`) streams each sequence's blocks once, in
place, for all sequences in one call; without it (no compiler, non-fp32 cache) each sequence's
blocks are gathered and attended with a grouped-query matmul. Decode on GPU / under CUDA graphs:
one padded batched gather. KV heads are never repeated. Prefill rows whose metadata lists image
spans (Gemma 3) widen the causal mask to "bidirectional within an image" (`image_mask.py`).

The interface is tensor-only: an impl holds its plain settings (heads, head size, scale,
window) from construction, and `forward` gets tensors, the cache and the step's metadata, never
the attention layer, so this package sits below `attention.layer` and never imports it.

An fp8 cache (`kv_cache_dtype`, `kv_quant.py`) is written quantized and dequantized where it
is read: the gathered keys and values of prefill (with cached context) and of the PyTorch
decodes, inside the C kernel, inside the Triton kernel. A prompt's own new K/V are attended
unquantized, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from tokenwise.attention.backends.encoder_only import encoder_only_attention
from tokenwise.attention.backends.kv_quant import write_rows
from tokenwise.attention.backends.packed_prefill import packed_prefill
from tokenwise.attention.backends.paged_reference import paged_decode_reference
from tokenwise.attention.backends.paged_rows import decode_per_sequence, len_blocks, read_blocks
from tokenwise.attention.backends.prefill_attention import attend_prefill
from tokenwise.attention.backends.single_sequence import single_sequence_attention
from tokenwise.attention.utils import AttentionType
from tokenwise.native import paged_decode as cpu_paged_decode

if TYPE_CHECKING:
    from tokenwise.attention.metadata import AttentionMetadata

# Types that attend within whole prompts of the step and keep no cache (`encoder_only.py`).
_NO_CACHE_TYPES = (AttentionType.ENCODER_ONLY, AttentionType.DECODER_NO_CACHE)
_TYPES = (AttentionType.DECODER, *_NO_CACHE_TYPES)


class TorchAttentionImpl:
    """One layer's attention: its settings are fixed at construction, its inputs are tensors.

    `attn_type` ENCODER_ONLY (BERT) attends bidirectionally within each sequence and never
    touches a cache (`encoder_only.py`); DECODER_NO_CACHE (a decoder run as a classifier) is
    the same with a causal mask; DECODER is the paged causal attention below.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
    ) -> None:
        if attn_type not in _TYPES:
            raise NotImplementedError(f"unsupported attention type {attn_type!r}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.attn_type = AttentionType(attn_type)
        self._heads = {"num_heads": num_heads, "num_kv_heads": num_kv_heads}
        self._heads |= {"head_size": head_size, "scale": scale}
        # vLLM's per-layer fp8 scales: the cache holds k / k_scale and v / v_scale. Python
        # floats (no tensor read per step); 1.0 unless the checkpoint gives them.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # gpt-oss's attention sinks: `[num_heads]` logits that join every softmax denominator
        # (set by the layer, a reference to its parameter: filled when weights load).
        self.sinks: torch.Tensor | None = None
        self._sinks_f32: torch.Tensor | None = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        """Write this step's K/V into `kv_cache` and attend; `[num_tokens, heads * head]`."""
        if self.attn_type in _NO_CACHE_TYPES:  # no cache: `kv_cache` is unused
            causal = self.attn_type is AttentionType.DECODER_NO_CACHE
            return encoder_only_attention(
                query, key, value, attn_metadata, causal=causal, **self._heads
            )
        if attn_metadata is None:  # profiling / warm-up pass: no cache, one sequence
            return single_sequence_attention(
                query,
                key,
                value,
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_size=self.head_size,
                scale=self.scale,
                sliding_window=self.sliding_window,
                softcap=self.logits_soft_cap,
                sinks=self.sinks,
            )
        num_tokens = query.shape[0]
        if (
            attn_metadata.num_prefills == 0
            and query.device.type == "cpu"
            and attn_metadata.seq_lens_tensor is not None
        ):
            out = self._decode_step_cpu(query, key, value, kv_cache, attn_metadata)
            if out is not None:
                return out
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        slots = attn_metadata.slot_mapping[:num_tokens]
        write_kv_cache(k, v, key_cache, value_cache, slots, self.k_scale, self.v_scale)

        output = torch.empty_like(q)
        n_prefill = attn_metadata.num_prefill_tokens
        if attn_metadata.num_prefills:
            prefill = self._prefill if q.device.type == "cpu" else self._prefill_packed
            prefill(q[:n_prefill], k, v, key_cache, value_cache, attn_metadata, output)
        if attn_metadata.num_decode_tokens:
            self._decode_into(
                q[n_prefill:], key_cache, value_cache, attn_metadata, output[n_prefill:]
            )
        return output.view(num_tokens, self.num_heads * self.head_size)

    def _decode_step_cpu(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor | None:
        """A decode-only CPU step in one C call (cache write, attention, output in the model's
        dtype); None where the kernel cannot take it. The general path below costs five or six
        torch ops around the kernel per layer, about as long as one stream's attention itself.
        """
        lib = cpu_paged_decode.load()
        if lib is None or not cpu_paged_decode.step_usable(query, key, value, kv_cache):
            return None
        return cpu_paged_decode.decode_step(
            lib,
            query,
            key,
            value,
            kv_cache,
            md.slot_mapping,
            md.block_tables,
            md.seq_lens_tensor,
            md.first_block_tensor,
            None if md.use_cuda_graph else md.total_seq_len,  # a CPU graph: lengths vary
            self.num_heads,
            self.sliding_window,
            self.scale,
            self.logits_soft_cap,
            self.k_scale,
            self.v_scale,
            self.sinks_f32(),
        )

    def _paged_settings(self) -> dict[str, Any]:
        """This layer's settings as the PyTorch paged paths take them (`packed_prefill`,
        `decode_per_sequence`); read per call: the sinks and fp8 scales arrive with weights."""
        return {
            "num_kv_heads": self.num_kv_heads,
            "scale": self.scale,
            "sliding_window": self.sliding_window,
            "softcap": self.logits_soft_cap,
            "k_scale": self.k_scale,
            "v_scale": self.v_scale,
            "sinks": self.sinks,
        }

    def sinks_f32(self) -> torch.Tensor | None:
        """The sinks as the C kernel reads them: contiguous float32, one tensor for the
        model's life (a CPU graph records its address). Made at the first decode, after the
        weights loaded; an fp32 model's parameter is used as it is."""
        if self.sinks is None:
            return None
        if self.sinks.dtype == torch.float32 and self.sinks.is_contiguous():
            return self.sinks
        if self._sinks_f32 is None:
            self._sinks_f32 = self.sinks.detach().float().contiguous()
        return self._sinks_f32

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        block_size = md.block_size
        all_spans = md.bidirectional_spans or []
        start = 0
        for i in range(md.num_prefills):
            q_len, ctx_len = md.query_lens[i], md.context_lens[i]
            end = start + q_len
            if ctx_len == 0:
                keys, values, key_offset = k[start:end], v[start:end], 0
            else:
                table = md.block_tables[i, : len_blocks(md, i)]
                key_offset = md.block_table_first_block[i] * block_size
                n_keys = ctx_len + q_len - key_offset
                keys = read_blocks(key_cache, table, q.dtype, self.k_scale)[:n_keys]
                values = read_blocks(value_cache, table, q.dtype, self.v_scale)[:n_keys]
            spans = all_spans[i] if i < len(all_spans) else ()
            output[start:end] = attend_prefill(
                q[start:end],
                keys,
                values,
                ctx_len,
                key_offset,
                spans,
                scale=self.scale,
                sliding_window=self.sliding_window,
                softcap=self.logits_soft_cap,
                sinks=self.sinks,
                gqa=self.group > 1,
            )
            start = end

    def _prefill_packed(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        """Every prefill of the step in one SDPA call (the GPU path; `_prefill` on CPU):
        `packed_prefill.py` (this step's K/V are in the cache already)."""
        packed_prefill(q, key_cache, value_cache, md, output, **self._paged_settings())

    def _decode_into(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        """CPU eager steps take the C kernel; GPU and graph steps the batched reference."""
        if md.use_cuda_graph or q.device.type != "cpu":
            output.copy_(self._decode(q, key_cache, value_cache, md))
        else:
            self._decode_cpu(q, key_cache, value_cache, md, output)

    def _decode_cpu(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        """CPU decode: the C kernel reads each block once where it lies (fp32, bf16 or fp8 caches,
        fp32 math). Other dtypes, or a machine where it cannot be built, take the PyTorch path.
        """
        lib = cpu_paged_decode.load()
        if lib is None or key_cache.dtype not in cpu_paged_decode.CACHE_DTYPES:
            decode_per_sequence(q, key_cache, value_cache, md, output, **self._paged_settings())
            return
        first = md.num_prefills
        direct = output.dtype == torch.float32 and output.is_contiguous()
        out = output if direct else torch.empty(output.shape, dtype=torch.float32)
        cpu_paged_decode.paged_decode(
            lib,
            q.to(torch.float32).contiguous(),
            key_cache,
            value_cache,
            md.block_tables[first:],
            md.seq_lens_tensor[first:],
            md.first_block_tensor[first:],
            self.sliding_window,
            self.scale,
            out,
            softcap=self.logits_soft_cap,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            sinks=self.sinks_f32(),
        )
        if not direct:
            output.copy_(out)

    def _decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """All decode rows at once over tables padded to the longest: `paged_decode_reference`."""
        lo, hi = md.num_prefills, md.num_prefills + q.shape[0]
        assert md.seq_lens_tensor is not None
        first_block = None
        if self.sliding_window is not None and not md.use_cuda_graph:
            # Eager steps trim windowed tables (graph steps keep them whole): say where each
            # row starts. A host-to-device copy, which is why it is not done under a graph.
            starts = md.block_table_first_block[lo:hi]
            if any(starts):
                first_block = torch.tensor(starts, dtype=torch.int32).to(q.device)
        return self._paged_decode_fn(q)(
            q,
            key_cache,
            value_cache,
            md.block_tables[lo:hi],
            md.seq_lens_tensor[lo:hi],
            self.scale,
            self.sliding_window,
            first_block,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )

    def _paged_decode_fn(self, q: torch.Tensor) -> Callable[..., torch.Tensor]:
        """The batched decode function (the GPU backend swaps in its Triton kernel)."""
        if self.logits_soft_cap or self.sinks is not None:
            return partial(paged_decode_reference, softcap=self.logits_soft_cap, sinks=self.sinks)
        return paged_decode_reference


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter this step's K/V into their slots; PAD slots (-1) land in the trash block. An
    fp8 cache gets `k / k_scale`, `v / v_scale`, saturated (`kv_quant.quantize`)."""
    flat_k = key_cache.view(-1, key.shape[1], key.shape[2])
    flat_v = value_cache.view(-1, value.shape[1], value.shape[2])
    trash_slot = flat_k.shape[0] - 1
    slots = torch.where(slot_mapping < 0, trash_slot, slot_mapping)
    write_rows(flat_k, slots, key, k_scale)
    write_rows(flat_v, slots, value, v_scale)


class TorchAttentionBackend:
    name = "torch"

    @staticmethod
    def get_impl_cls() -> type[TorchAttentionImpl]:
        return TorchAttentionImpl

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's cache; one extra trash block receives PAD writes."""
        return (2, num_blocks + 1, block_size, num_kv_heads, head_size)
