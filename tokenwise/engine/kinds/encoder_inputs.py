"""Encoder inputs of a request and the blocks of its cross KV cache.

An encoder-decoder request has two inputs: what its encoder reads (token ids for BART, log-mel
features for Whisper) and the decoder prompt, which is generated from like any prompt. The
encoder runs once, in the step that admits the request; each decoder layer's cross-attention
writes the encoder's keys and values into blocks of its cross cache then, and reads them every
decoder step after.

Cross blocks come from the same pool as the decoder's self-attention blocks (same block size;
each cross-attention layer has a cache tensor of its own, indexed by the same block ids), so one
pool bounds both and "every block is free" means both caches. A request holds two tables: its
self-attention table (`BlockManager`'s) and its cross table (here). Cross blocks are never
registered for prefix caching: they hold one request's encoder output, which no later prompt
can be known to share. They are freed with the request, and on preemption, after which the
encoder runs again when the request is admitted again.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from tokenwise.engine.block_manager import BlockManager


@dataclass(eq=False)
class EncoderInputs:
    """What a request's encoder reads, and how many encoder tokens (cross K/V rows) it makes.

    `token_ids` for a text encoder; `input_features` (`[num_mel_bins, frames]`, already padded
    to the model's window) for an audio encoder, whose token count is fixed by the model.
    """

    num_tokens: int
    token_ids: list[int] | None = None
    input_features: torch.Tensor | None = None
    prompt: str | None = None  # the encoder prompt's text, when it was given as text

    def __post_init__(self) -> None:
        if (self.token_ids is None) == (self.input_features is None):
            raise ValueError("EncoderInputs needs exactly one of token_ids and input_features")
        if self.num_tokens < 1:
            raise ValueError(f"an encoder needs at least one token, got {self.num_tokens}")


class CrossBlockManager(BlockManager):
    """`BlockManager` plus one cross-attention block table per request, from the same pool."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size, enable_caching)
        self._cross: dict[str, list[int]] = {}

    def num_cross_blocks(self, num_encoder_tokens: int) -> int:
        return -(-num_encoder_tokens // self.block_size)

    def allocate_cross_slots(self, request_id: str, num_encoder_tokens: int) -> list[int] | None:
        """The request's cross table for `num_encoder_tokens` rows; None when the pool is short.

        All-or-nothing, like `allocate_slots`. Fresh blocks only: never looked up in or
        registered with the prefix cache.
        """
        if request_id in self._cross:
            raise ValueError(f"request {request_id} already holds cross blocks")
        needed = self.num_cross_blocks(num_encoder_tokens)
        if needed > self.pool.num_free:
            return None
        table = [self.pool.allocate() for _ in range(needed)]
        self._cross[request_id] = table
        return table

    def get_cross_block_table(self, request_id: str) -> list[int]:
        return self._cross.get(request_id, [])

    def free_cross(self, request_id: str) -> None:
        """Give the request's cross blocks back (they were never cached: nothing to evict)."""
        for block_id in reversed(self._cross.pop(request_id, [])):
            self.pool.release(block_id)

    def free(self, request_id: str, discard_cached: bool = False) -> None:
        """Both of the request's tables: finished, aborted or preempted alike."""
        self.free_cross(request_id)
        super().free(request_id, discard_cached)

    def _check_other_holders(self, refs: Counter[int]) -> None:
        """Cross tables hold blocks too, and none of them may be in the prefix cache."""
        for request_id, table in self._cross.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"request {request_id} holds a cross block twice")
            refs.update(table)
            cached = [b for b in table if self.pool.blocks[b].block_hash is not None]
            if cached:
                raise AssertionError(f"cross blocks {cached} of {request_id} are in the cache")

    @property
    def num_cross_tables(self) -> int:
        """Requests holding cross blocks now (0 once every request has ended)."""
        return len(self._cross)
