"""Encoder inputs of a request, and how its cross KV cache is kept.

An encoder-decoder request has two inputs: what its encoder reads (token ids for BART, log-mel
features for Whisper) and the decoder prompt, which is generated from like any prompt. The
encoder runs once, in the step that admits the request; each decoder layer's cross-attention
writes the encoder's keys and values into blocks of its cross cache then, and reads them every
decoder step after.

Cross blocks come from the same pool as the decoder's self-attention blocks (same block size;
each cross-attention layer has a cache tensor of its own, indexed by the same block ids), so one
pool bounds both and "every block is free" means both caches. A request holds two tables, both
owned by the `BlockManager` (its `SELF_ATTN` and `CROSS_ATTN` KV-cache groups). Cross blocks are never
registered for prefix caching: they hold one request's encoder output, which no later prompt
can be known to share. They are freed with the request, and on preemption, after which the
encoder runs again when the request is admitted again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
