"""Prefix-cache keys: the chain hash of a full block of tokens.

Two blocks with equal hashes hold the K/V (or the state snapshot) of the same token prefix, so
they may be shared. Every KV-cache group hashes the same tokens alike; a group other than 0
appends its index to the key (`kv_cache.managers`), since its copy lives in blocks of its own.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

#: Parent "hash" of block 0.  Empty, so the root hash only depends on salt and tokens.
ROOT_PARENT_HASH = b""

#: `(offset, length, content hash)` of each image of a prompt (its placeholder tokens).
ImageSpans = Sequence[tuple[int, int, bytes]]


def hash_block_tokens(
    parent_hash: bytes,
    token_ids: Sequence[int],
    cache_salt: str | None = None,
    extra_keys: bytes = b"",
) -> bytes:
    """Chain hash of one full block.

    Including the parent hash makes the hash identify the whole prefix, not just this block's
    tokens.  Tokens are packed as little-endian int64 so the hash does not depend on the host.
    The salt only needs to enter the root block: every later hash inherits it via the chain.
    `extra_keys` is what the tokens alone do not say about the block's K/V: the content
    hashes of the images whose placeholder tokens it covers (placeholders of two images are
    the same token ids).
    """
    data = parent_hash
    if cache_salt:
        data += cache_salt.encode("utf-8")
    if extra_keys:
        data += b"\x00images:" + extra_keys
    data += struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256(data).digest()


def block_extra_keys(images: ImageSpans, start: int, end: int) -> bytes:
    """The hashes of the images with placeholder tokens in `[start, end)`, in order."""
    return b"".join(h for offset, length, h in images if offset < end and offset + length > start)


def extend_chain(
    hashes: list[bytes],
    token_ids: Sequence[int],
    count: int,
    block_size: int,
    cache_salt: str | None = None,
    images: ImageSpans = (),
) -> list[bytes]:
    """`hashes` (a request's chain so far) extended in place to its first `count` blocks."""
    bs = block_size
    while len(hashes) < count:
        i = len(hashes)
        parent = hashes[-1] if hashes else ROOT_PARENT_HASH
        salt = cache_salt if i == 0 else None
        extra = block_extra_keys(images, i * bs, (i + 1) * bs) if images else b""
        hashes.append(hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], salt, extra))
    return hashes
