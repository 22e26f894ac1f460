"""What a model kind may change in the scheduler: the hooks, with a decoder's defaults.

Apart from `scheduler.py` because it is the interface between the scheduler and the model
kinds (`engine/kinds/`), not placement logic: the scheduler calls these at admission and when
it sizes a chunk; a decoder-only model needs none of them (the defaults here), an
encoder-decoder model runs its encoder and holds cross-attention blocks from admission on,
and a multimodal one keys its blocks by its images and keeps an image's placeholder run in
one chunk. Reading one kind's scheduler means reading its overrides of these, nothing else.
"""

from __future__ import annotations

from tokenwise.engine.block_manager import ImageSpans
from tokenwise.engine.request import Request


class KindHooks:
    """The scheduler's extension points for model kinds (nothing extra, for a decoder)."""

    def admission_tokens(self, request: Request) -> int:
        """Tokens the request runs besides its own in the step that admits it (and again after
        a preemption), sharing that step's token budget. None for a decoder-only model."""
        return 0

    def admission_blocks(self, request: Request) -> int:
        """Blocks the request holds in its other KV-cache groups while it runs (none here)."""
        return 0

    def allocate_admission_blocks(self, request: Request) -> list[int] | None:
        """Allocate those blocks, all or nothing (None: the pool is short)."""
        return []

    def drop_chunk(self, request: Request) -> None:
        """The chunk `limit_chunk` allowed is not scheduled after all (no blocks for it)."""

    def image_spans(self, request: Request) -> ImageSpans:
        """The images of the request's prompt, which key its blocks' hashes (none here)."""
        return ()

    def limit_chunk(self, request: Request, num_computed: int, num_new: int) -> int:
        """How many of `num_new` tokens the request's next chunk may take (all, here; 0: none
        this step). A kind whose inputs must not be cut shortens chunks to end before them."""
        return num_new
