"""Helpers shared by the attention backends.

Every backend has to turn sequences into slot indices of the paged KV cache and has to
pick the right lengths / block tables for the kind of attention it is running. Keeping
that logic here means the backends agree on it, and it can be tested without a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

# A slot the cache writer must skip: padding tokens and tokens that already fell out of a
# sliding window have no place in the cache, and -1 can never be a real slot index.
PAD_SLOT_ID = -1

# Below this many tokens, building numpy arrays costs more than a plain loop saves, so
# short ranges (decode steps, small chunks) stay in Python.
_COMPUTE_SLOT_MAPPING_NUMPY_THRESHOLD = 256

BlockTables = dict[int, list[int] | None] | None


class AttentionType(str, Enum):
    """Which tokens attend to which; decides the lengths and tables a backend uses.

    A ``str`` enum so that config strings such as ``"decoder"`` compare equal to members.
    """

    DECODER = "decoder"  # causal self-attention over the decoder's own KV cache
    ENCODER = "encoder"  # encoder self-attention in an encoder-decoder model, no cache
    ENCODER_ONLY = "encoder_only"  # bidirectional attention of encoder-only models
    ENCODER_DECODER = "encoder_decoder"  # decoder queries over the cached encoder output
    # Causal attention within each whole prompt and no cache: a decoder run as a classifier
    # (Qwen3ForSequenceClassification) reads each prompt once, in one step, like an encoder.
    DECODER_NO_CACHE = "decoder_no_cache"


def is_block_tables_empty(block_tables: BlockTables) -> bool:
    """True when no sequence has a block table, which is what a profile run looks like."""
    if block_tables is None:
        return True
    return all(table is None for table in block_tables.values())


def compute_slot_mapping_start_idx(
    is_prompt: bool, query_len: int, context_len: int, sliding_window: int | None
) -> int:
    """First prompt position that still needs a cache slot.

    With a sliding window only the last ``sliding_window`` prompt tokens can ever be
    attended to again, so earlier ones are not written (their blocks are being reused).
    ``context_len`` is part of the shared signature but does not change the answer.
    """
    del context_len
    if is_prompt and sliding_window is not None:
        return max(0, query_len - sliding_window)
    return 0


def _slots_python(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Slots of positions ``start .. end - 1``; the cheap path for a handful of tokens."""
    return [block_table[i // block_size] * block_size + i % block_size for i in range(start, end)]


def _slots_numpy(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Same result as :func:`_slots_python`, vectorised for long prompts."""
    positions = np.arange(start, end, dtype=np.int64)
    table = np.asarray(block_table, dtype=np.int64)
    slots = table[positions // block_size] * block_size + positions % block_size
    return slots.tolist()


def compute_slot_mapping(
    is_profile_run: bool,
    slot_mapping: list[int],
    seq_id: int,
    seq_len: int,
    context_len: int,
    start_idx: int,
    block_size: int,
    block_tables: BlockTables,
) -> None:
    """Append the cache slots of one sequence's new tokens to ``slot_mapping``.

    The new tokens are positions ``context_len .. seq_len - 1``; exactly one entry is
    appended for each so the mapping lines up with the flattened batch. Positions before
    ``start_idx`` (outside the sliding window) get :data:`PAD_SLOT_ID`. A profile run has
    no block tables at all, so every token of the sequence is padded.
    """
    if is_profile_run or is_block_tables_empty(block_tables):
        slot_mapping.extend([PAD_SLOT_ID] * seq_len)
        return
    if not 0 <= context_len <= seq_len:
        raise ValueError(f"need 0 <= context_len <= seq_len, got {context_len=} {seq_len=}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    assert block_tables is not None  # narrowed by is_block_tables_empty above
    block_table = block_tables.get(seq_id)
    if block_table is None:
        raise ValueError(f"no block table for sequence {seq_id}")

    # Clamping to seq_len keeps the "one entry per new token" promise even for a
    # start_idx past the end of the sequence.
    first_written = min(max(start_idx, context_len), seq_len)
    slot_mapping.extend([PAD_SLOT_ID] * (first_written - context_len))
    if first_written == seq_len:
        return
    blocks_needed = (seq_len - 1) // block_size + 1
    if len(block_table) < blocks_needed:
        raise ValueError(
            f"block table of sequence {seq_id} has {len(block_table)} blocks, "
            f"{blocks_needed} needed for {seq_len} tokens of block size {block_size}"
        )
    if seq_len - first_written >= _COMPUTE_SLOT_MAPPING_NUMPY_THRESHOLD:
        slot_mapping.extend(_slots_numpy(block_table, first_written, seq_len, block_size))
    else:
        slot_mapping.extend(_slots_python(block_table, first_written, seq_len, block_size))


def is_all_encoder_attn_metadata_set(attn_metadata: Any) -> bool:
    """Whether the metadata carries what encoder (self-)attention needs."""
    return all(
        getattr(attn_metadata, name, None) is not None
        for name in ("encoder_seq_lens", "encoder_seq_lens_tensor", "max_encoder_seq_len")
    )


def is_all_cross_attn_metadata_set(attn_metadata: Any) -> bool:
    """Whether the metadata also carries the cache layout of the encoder's KV."""
    return (
        is_all_encoder_attn_metadata_set(attn_metadata)
        and getattr(attn_metadata, "cross_slot_mapping", None) is not None
        and getattr(attn_metadata, "cross_block_tables", None) is not None
    )


def _as_attention_type(attn_type: AttentionType | str) -> AttentionType:
    """Accept plain strings too, failing with a message that names the bad value."""
    try:
        return AttentionType(attn_type)
    except ValueError:
        raise ValueError(f"unknown attention type {attn_type!r}") from None


def get_num_prefill_decode_query_kv_tokens(
    attn_metadata: Any, attn_type: AttentionType | str
) -> tuple[int, int, int]:
    """(prefill query tokens, prefill KV tokens, decode query tokens) for one attention call.

    They differ from the plain batch counts whenever keys come from the encoder: encoder
    attention runs over encoder tokens only, and cross-attention's keys are encoder tokens
    while its queries are decoder tokens. Only `num_encoder_tokens` is read, so only it is
    required; `is_all_encoder_attn_metadata_set` is the stricter check for kernels that need
    the per-sequence encoder lengths too.
    """
    kind = _as_attention_type(attn_type)
    if kind in (AttentionType.ENCODER, AttentionType.ENCODER_DECODER):
        num_encoder_tokens = getattr(attn_metadata, "num_encoder_tokens", None)
        if num_encoder_tokens is None:
            raise ValueError(
                f"{kind.name} attention needs num_encoder_tokens set in the attention metadata"
            )
        if kind is AttentionType.ENCODER:
            return num_encoder_tokens, num_encoder_tokens, 0
        return (
            attn_metadata.num_prefill_tokens,
            num_encoder_tokens,
            attn_metadata.num_decode_tokens,
        )
    num_prefill_tokens = attn_metadata.num_prefill_tokens
    return num_prefill_tokens, num_prefill_tokens, attn_metadata.num_decode_tokens


def get_seq_len_block_table_args(
    attn_metadata: Any, is_prompt: bool, attn_type: AttentionType | str
) -> tuple[Any, int | None, Any]:
    """(sequence lengths tensor, max sequence length, block tables) for a paged kernel.

    Cross-attention reads the encoder's KV through its own block tables; encoder
    attention reads no cache at all, hence ``None`` for its tables.
    """
    kind = _as_attention_type(attn_type)
    if kind is AttentionType.DECODER:
        max_seq_len = (
            attn_metadata.max_prefill_seq_len if is_prompt else attn_metadata.max_decode_seq_len
        )
        return attn_metadata.seq_lens_tensor, max_seq_len, attn_metadata.block_tables
    if kind is AttentionType.ENCODER_DECODER:
        return (
            attn_metadata.encoder_seq_lens_tensor,
            attn_metadata.max_encoder_seq_len,
            attn_metadata.cross_block_tables,
        )
    if kind is AttentionType.ENCODER:
        return attn_metadata.encoder_seq_lens_tensor, attn_metadata.max_encoder_seq_len, None
    raise ValueError(f"get_seq_len_block_table_args does not support attention type {kind.name}")


@dataclass(frozen=True)
class MLADims:
    """Sizes of multi-head latent attention (DeepSeek-V2 style) projections.

    ``q_lora_rank`` is None when queries are projected directly instead of through a
    low-rank bottleneck.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


_REQUIRED_MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def get_mla_dims(model_config: Any) -> MLADims:
    """Read the MLA sizes from a HF config or from a wrapper exposing ``hf_config``."""
    hf_config = getattr(model_config, "hf_config", model_config)
    values: dict[str, int] = {}
    for name in _REQUIRED_MLA_FIELDS:
        value = getattr(hf_config, name, None)
        if value is None:
            raise ValueError(f"model config has no {name!r}; it is required for MLA")
        values[name] = value
    return MLADims(q_lora_rank=getattr(hf_config, "q_lora_rank", None), **values)
