"""Token type ids (BERT's segment A / B) carried inside the token ids of a step.

A cross-encoder reads a (query, document) pair as one sequence whose second segment has token
type 1. Models here see one flat stream of token ids and nothing else about a request, so the
type rides in the id's high bits: the engine packs `id | type << TOKEN_TYPE_SHIFT` when it
builds a request, and the model's embedding splits them again. No vocabulary comes near 2**30
ids, and the input buffers hold int64, so the packed ids pass through the runner unchanged.
A request whose types are all 0 (every embedding prompt) is not packed at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TOKEN_TYPE_SHIFT = 30
_ID_MASK = (1 << TOKEN_TYPE_SHIFT) - 1


def pack_token_types(token_ids: Sequence[int], token_type_ids: Sequence[int]) -> list[int]:
    """The ids with each token's type in its high bits (the ids as they are if all are 0)."""
    if not any(token_type_ids):
        return list(token_ids)
    return [t | (k << TOKEN_TYPE_SHIFT) for t, k in zip(token_ids, token_type_ids, strict=True)]


def unpack_token_ids(token_ids: Sequence[int]) -> list[int]:
    """The plain token ids of a packed list (what a request reports back)."""
    return [t & _ID_MASK for t in token_ids]


def split_token_types(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, token type ids) of a step's packed input ids."""
    return input_ids & _ID_MASK, input_ids >> TOKEN_TYPE_SHIFT
