"""Which captured graph (if any) a batch runs with (SPEC §2).

Pure Python, so the decisions are unit-tested on CPU; only capture and replay need a GPU.
Keys are `BatchDescriptor`s of *padded* batches. Mixed-batch (piecewise) graphs are captured
under relaxed keys (token count only); full graphs for uniform decode batches also carry the
number of requests. Dispatch prefers an exact FULL key, then a relaxed FULL key, then a
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
        self.keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.PIECEWISE: set(),
            CUDAGraphMode.FULL: set(),
        }
        self.keys_initialized = False

    def _padded_descriptor(
        self, num_tokens: int, uniform_decode: bool, has_lora: bool
    ) -> BatchDescriptor:
        padded = self.compilation_config.pad_for_cudagraph(num_tokens)
        assert padded is not None
        if uniform_decode and self.cudagraph_mode.has_mode(CUDAGraphMode.FULL):
            return BatchDescriptor(
                padded, padded // self.uniform_decode_query_len, uniform=True, has_lora=has_lora
            )
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
    ) -> None:
        """Derive the keys to capture from the mode and the capture sizes."""
        self.cudagraph_mode = cudagraph_mode
        self.uniform_decode_query_len = uniform_decode_query_len
        for mode_keys in self.keys.values():
            mode_keys.clear()
        sizes = self.compilation_config.cudagraph_capture_sizes or []
        mixed = cudagraph_mode.mixed_mode()
        if mixed in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            for size in sizes:
                desc = self._padded_descriptor(size, False, has_lora)
                self.add_key(mixed, desc.relax_for_mixed_batch_cudagraphs())
        if cudagraph_mode.decode_mode() == CUDAGraphMode.FULL and cudagraph_mode.separate_routine():
            max_tokens = uniform_decode_query_len * self.max_num_seqs
            for size in sizes:
                if uniform_decode_query_len <= size <= max_tokens:
                    self.add_key(CUDAGraphMode.FULL, self._padded_descriptor(size, True, has_lora))
        self.keys_initialized = True

    def dispatch(
        self,
        num_tokens: int,
        uniform_decode: bool = False,
        has_lora: bool = False,
        disable_full: bool = False,
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        eager = (CUDAGraphMode.NONE, BatchDescriptor(num_tokens))
        if (
            not self.keys_initialized
            or self.cudagraph_mode == CUDAGraphMode.NONE
            or num_tokens > self.compilation_config.max_capture_size
        ):
            return eager
        desc = self._padded_descriptor(num_tokens, uniform_decode, has_lora)
        relaxed = desc.relax_for_mixed_batch_cudagraphs()
        if not disable_full:
            if desc in self.keys[CUDAGraphMode.FULL]:
                return CUDAGraphMode.FULL, desc
            if relaxed in self.keys[CUDAGraphMode.FULL]:
                return CUDAGraphMode.FULL, relaxed
        if relaxed in self.keys[CUDAGraphMode.PIECEWISE]:
            return CUDAGraphMode.PIECEWISE, relaxed
        return eager
