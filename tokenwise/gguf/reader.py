"""Open a GGUF file and read its metadata as plain Python values.

Why a wrapper around `gguf.GGUFReader`: a missing file and a file that is not GGUF should
each fail with a message naming the path, not with numpy's or the reader's internals, and the
metadata is easier to use as one `{key: value}` dict (strings decoded, arrays as lists).
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

GGUF_MAGIC = b"GGUF"


def is_gguf_path(path: str) -> bool:
    """True when `path` names a GGUF file (by its `.gguf` suffix, or its magic bytes)."""
    if path.endswith(".gguf"):
        return True
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def open_gguf(path: str) -> Any:
    """A `gguf.GGUFReader` over `path` (memory-mapped: nothing is read until used)."""
    import gguf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path!r} is not a readable GGUF file ({exc})") from exc


def _metadata_of(reader: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the header (version, counts), not model metadata
            continue
        metadata[key] = field.contents()
    return metadata


@lru_cache(maxsize=4)
def _cached_metadata(path: str, size: int, mtime_ns: int) -> tuple[dict[str, Any], tuple[str, ...]]:
    reader = open_gguf(path)
    return _metadata_of(reader), tuple(t.name for t in reader.tensors)


def read_metadata(path: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    """`(metadata, tensor names)` of a GGUF file; cached per file version, since the config,
    the tokenizer and the loader each need it and the vocabulary arrays are large."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    stat = os.stat(path)
    metadata, names = _cached_metadata(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
    return dict(metadata), names
