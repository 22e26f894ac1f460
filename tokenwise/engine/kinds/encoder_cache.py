"""The runner's encoder cache: each image's embeddings, from its first use until the last
request that needs them has prefilled past its placeholders.

A chunked prefill may stop inside an image's placeholder run, and the next chunk needs the
rest of the same embeddings: running the vision tower again for every chunk would multiply
its cost, so the embeddings are kept. They are keyed by the image's content hash, so two
requests with the same image (running at the same time) share one encoding. Each entry
counts the requests holding it; a request lets go when its prefill has consumed the image
or when it leaves the batch (finished, aborted, preempted: a preempted request that comes back
takes the entry again, recomputing it if it is gone). An entry nobody holds is dropped at
once: memory is bounded by the images of the prefills in flight.
"""

from __future__ import annotations

import torch

from tokenwise.engine.kinds.image_holds import ImageHolds


class EncoderCache:
    def __init__(self) -> None:
        self._embeds: dict[bytes, torch.Tensor] = {}
        self._holds = ImageHolds()
        self.num_hits = 0  # a request found the image's embeddings already computed
        self.num_misses = 0  # the vision tower had to run for it

    def __len__(self) -> int:
        return len(self._embeds)

    def get(self, request_id: str, key: bytes) -> torch.Tensor | None:
        """The embeddings of `key`, now held by `request_id`; None when not cached (then the
        caller encodes the image and `put`s it). A request's first lookup of an image counts
        as a hit or a miss; the lookups of its later chunks do not."""
        embeds = self._embeds.get(key)
        if not self._holds.holds(request_id, key):
            if embeds is None:
                self.num_misses += 1
            else:
                self.num_hits += 1
        if embeds is not None:
            self._holds.hold(request_id, key)
        return embeds

    def served_by_pending(self) -> None:
        """The last miss is served by an encoding another request of the same step already
        asked for: it counts as a hit (the tower runs once for both)."""
        self.num_misses -= 1
        self.num_hits += 1

    def put(self, request_id: str, key: bytes, embeds: torch.Tensor) -> None:
        self._embeds[key] = embeds
        self._holds.hold(request_id, key)

    def release(self, request_id: str, key: bytes) -> None:
        """`request_id` needs `key` no more (its prefill has passed the image)."""
        if self._holds.release(request_id, key):
            del self._embeds[key]

    def release_request(self, request_id: str) -> None:
        """Everything `request_id` holds (it left the batch)."""
        for key in self._holds.keys_of(request_id):
            self.release(request_id, key)
