"""Which requests hold which image (by content hash), both ways.

The runner's encoder cache (`encoder_cache.py`) keeps an image's embeddings while some request
holds it; the scheduler's encoder budget (`encoder_budget.py`) mirrors those holds without the
tensors, to know which images a step must encode. Both take and let go by the same rules, so
they share this record of the holds.
"""

from __future__ import annotations


class ImageHolds:
    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._held_by: dict[str, set[bytes]] = {}

    def __len__(self) -> int:
        """Images some request holds."""
        return len(self._holders)

    def is_held(self, key: bytes) -> bool:
        return key in self._holders

    def holds(self, request_id: str, key: bytes) -> bool:
        return key in self._held_by.get(request_id, ())

    def hold(self, request_id: str, key: bytes) -> None:
        self._holders.setdefault(key, set()).add(request_id)
        self._held_by.setdefault(request_id, set()).add(key)

    def release(self, request_id: str, key: bytes) -> bool:
        """`request_id` lets go of `key` (if it held it); True when nobody holds `key` now
        and it was held before (the caller drops what it kept for it)."""
        held = self._held_by.get(request_id)
        if held is None or key not in held:
            return False
        held.discard(key)
        if not held:
            del self._held_by[request_id]
        holders = self._holders[key]
        holders.discard(request_id)
        if holders:
            return False
        del self._holders[key]
        return True

    def keys_of(self, request_id: str) -> list[bytes]:
        """The images `request_id` holds (a copy: safe to release while iterating)."""
        return list(self._held_by.get(request_id, ()))
