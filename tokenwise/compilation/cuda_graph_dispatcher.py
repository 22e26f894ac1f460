"""Which captured graph (if any) a batch runs with (docs/forward-context.md §2).

Pure Python, so the decisions are unit-tested on CPU; only capture and replay need a GPU.
Keys are `BatchDescriptor`s of *padded* batches. Mixed-batch (piecewise) graphs are captured
under relaxed keys (token count only); full graphs for uniform decode batches also carry the
number of requests. With speculative decoding a second family of full keys covers
verification batches where every request runs `1 + k` query tokens (`verify_query_len`):
same padded token counts, `num_reqs = padded // (1 + k)`. Dispatch prefers an exact FULL key, then a relaxed FULL key, then a
PIECEWISE key, and otherwise runs eagerly with the unpadded size.
"""

from __future__ import annotations

from tokenwise.config import CompilationConfig, CUDAGraphMode
from tokenwise.forward_context import BatchDescriptor


class CUDAGraphDispatcher:
    def __init__(self, compilation_config: CompilationConfig, max_num_seqs: int) -> None:
        self.compilation_config = compilation_config
        self.max_num_seqs = max_num_seqs
        self.cudagraph_mode = CUDAGraphMode.NONE
        self.uniform_decode_query_len = 1
        self.verify_query_len: int | None = None  # 1 + k under speculative decoding
        self.keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.PIECEWISE: set(),
            CUDAGraphMode.FULL: set(),
        }
        self.keys_initialized = False

    def _padded_descriptor(
        self, num_tokens: int, uniform_decode: bool, has_lora: bool, query_len: int | None = None
    ) -> BatchDescriptor:
        padded = self.compilation_config.pad_for_cudagraph(num_tokens)
        assert padded is not None
        if uniform_decode and self.cudagraph_mode.has_mode(CUDAGraphMode.FULL):
            q = self.uniform_decode_query_len if query_len is None else query_len
            return BatchDescriptor(padded, padded // q, uniform=True, has_lora=has_lora)
        return BatchDescriptor(padded, min(padded, self.max_num_seqs), False, has_lora)

    def add_key(self, mode: CUDAGraphMode, descriptor: BatchDescriptor) -> None:
        if mode not in self.keys:
            raise ValueError(f"graph keys exist for PIECEWISE and FULL only, got {mode}")
        self.keys[mode].add(descriptor)

    def add_lora_keys(self) -> None:
        """Also capture every key for batches that use LoRA adapters (`has_lora=True`).

        Their graphs hold the adapters' matmuls, which base-model batches skip, so an engine
        serving LoRA keeps two sets and each step picks by `has_lora`.
        """
        for mode_keys in self.keys.values():
            mode_keys |= {key._replace(has_lora=True) for key in mode_keys}

    def initialize_cudagraph_keys(
        self,
        cudagraph_mode: CUDAGraphMode,
        uniform_decode_query_len: int = 1,
        has_lora: bool = False,
        verify_query_len: int | None = None,
    ) -> None:
        """Derive the keys to capture from the mode and the capture sizes.

        `verify_query_len` (1 + num_speculative_tokens) adds full keys for uniform
        verification batches next to the decode keys, when the mode has FULL decode graphs.
        """
        if verify_query_len is not None and verify_query_len < 2:
            raise ValueError(f"verify_query_len must be >= 2 (1 + drafts), got {verify_query_len}")
        self.cudagraph_mode = cudagraph_mode
        self.uniform_decode_query_len = uniform_decode_query_len
        self.verify_query_len = verify_query_len
        for mode_keys in self.keys.values():
            mode_keys.clear()
        sizes = self.compilation_config.cudagraph_capture_sizes or []
        mixed = cudagraph_mode.mixed_mode()
        if mixed in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            for size in sizes:
                desc = self._padded_descriptor(size, False, has_lora)
                self.add_key(mixed, desc.relax_for_mixed_batch_cudagraphs())
        if cudagraph_mode.decode_mode() == CUDAGraphMode.FULL and cudagraph_mode.separate_routine():
            query_lens = [uniform_decode_query_len]
            if verify_query_len is not None and verify_query_len != uniform_decode_query_len:
                query_lens.append(verify_query_len)
            for q in query_lens:
                for size in sizes:
                    if q <= size <= q * self.max_num_seqs:
                        desc = self._padded_descriptor(size, True, has_lora, q)
                        self.add_key(CUDAGraphMode.FULL, desc)
        self.keys_initialized = True

    def dispatch(
        self,
        num_tokens: int,
        uniform_decode: bool = False,
        has_lora: bool = False,
        disable_full: bool = False,
        uniform_query_len: int | None = None,
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The graph mode and padded key for a batch; `uniform_query_len` is the query length
        every request of a uniform batch runs (default: the decode query length)."""
        eager = (CUDAGraphMode.NONE, BatchDescriptor(num_tokens))
        if (
            not self.keys_initialized
            or self.cudagraph_mode == CUDAGraphMode.NONE
            or num_tokens > self.compilation_config.max_capture_size
        ):
            return eager
        desc = self._padded_descriptor(num_tokens, uniform_decode, has_lora, uniform_query_len)
        relaxed = desc.relax_for_mixed_batch_cudagraphs()
        if not disable_full:
            if desc in self.keys[CUDAGraphMode.FULL]:
                return CUDAGraphMode.FULL, desc
            if relaxed in self.keys[CUDAGraphMode.FULL]:
                return CUDAGraphMode.FULL, relaxed
        if relaxed in self.keys[CUDAGraphMode.PIECEWISE]:
            return CUDAGraphMode.PIECEWISE, relaxed
        return eager
