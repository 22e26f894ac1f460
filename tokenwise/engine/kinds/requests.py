"""The requests of the kinds that need more than `Request`: embeddings, encoder-decoder, images.

`Request` is what every kind shares (tokens, progress, sampling, output state). A kind whose
requests carry more subclasses it here, below the scheduler and the runner that read the extra
fields: the embedding request's pooling settings (read by the pooling runner) and the
encoder-decoder request's encoder input (budgeted by its scheduler, run by its runner).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenwise.engine.kinds.encoder_inputs import EncoderInputs
from tokenwise.engine.kinds.image_inputs import ImageInput, hash_spans
from tokenwise.engine.request import Request
from tokenwise.pooling.params import PoolingParams


@dataclass(eq=False)
class EmbeddingRequest(Request):
    """A prompt to embed; its `sampling_params` are a placeholder that nothing reads."""

    pooling_params: PoolingParams = field(default_factory=PoolingParams)

    def runner_inputs(self) -> dict[str, Any]:
        return {"pooling_params": self.pooling_params}


@dataclass(eq=False)
class EncoderDecoderRequest(Request):
    """A decoder prompt (`prompt_token_ids`) and what the encoder reads.

    The encoder runs in the step that admits the request (again after a preemption), and its
    K/V fill the request's blocks of the CROSS_ATTN KV-cache group.
    """

    encoder_inputs: EncoderInputs | None = None

    @property
    def num_encoder_tokens(self) -> int:
        """Rows of cross K/V the encoder makes."""
        return 0 if self.encoder_inputs is None else self.encoder_inputs.num_tokens

    def runner_inputs(self) -> dict[str, Any]:
        return {"encoder_inputs": self.encoder_inputs}


@dataclass(eq=False)
class MultiModalRequest(Request):
    """A prompt with images: each image's placeholder run, pixels and content hash.

    The runner embeds an image when the request's prefill reaches its placeholders; the
    scheduler keys the prefix cache by the hashes of the images each block covers. (The 3-D
    positions follow from the token ids and the images, so they need no key of their own.)
    """

    images: list[ImageInput] = field(default_factory=list)
    # M-RoPE models (Qwen2.5-VL): the prompt's [3, prompt_len] positions (None for a
    # text-only prompt) and the offset of every later token's position from its index.
    mrope_positions: np.ndarray | None = None
    mrope_position_delta: int = 0
    # Gemma 3: each image's tokens attend to each other both ways, so a chunk never ends
    # inside an image (`MultiModalScheduler.limit_chunk`).
    whole_images: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.image_hash_spans = hash_spans(self.images)

    def runner_inputs(self) -> dict[str, Any]:
        return {
            "images": self.images,
            "mrope_positions": self.mrope_positions,
            "mrope_position_delta": self.mrope_position_delta,
        }
