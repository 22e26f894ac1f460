"""The draft model's forward passes: its own weights, KV cache and forward context.

A draft model for speculative decoding is an ordinary decoder checkpoint, smaller than the
target, with the target's vocabulary. `DraftRunner` loads it with the engine's loader under an
`EngineConfig` of its own (so its attention layers enter a layer registry of their own and
never collide with the target's names), gives every attention layer a KV cache tensor of its
own and runs it eagerly (no compilation, no graphs: its passes are small and their shapes vary).

Its cache is addressed by the *target's* block ids: it has the target pool's `num_blocks`
blocks, of the same size, so a request's target block table addresses its draft K/V too. It
is the pool's second KV group: the engine's KV sizing counts a draft block beside each target
block (and the scratch blocks below) in the one memory budget, then `allocate`s it.
Rejected drafts then need no rollback of their own: the draft writes the tokens that were
really kept over them at the same slots. After the shared blocks come `num_scratch_blocks`
more, which only the draft uses: its look-ahead positions may lie beyond the blocks the
scheduler has allocated so far (it allocates them for the next step), and are written there.

A pass is a list of `DraftSeq`s (tokens after a cached context, and the block table they are
read and written through); the runner lays them out prefills first, builds one metadata object
per attention spec with the engine's `CommonMetadataBuilder`, runs the model under a forward
context made for this pass, and returns the argmax token after each sequence that asks for one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenwise.attention.layer import Attention, AttentionLayerBase
from tokenwise.attention.metadata import AttentionMetadata, CommonMetadataBuilder
from tokenwise.attention.utils import AttentionType
from tokenwise.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ParallelConfig,
)
from tokenwise.forward_context import create_forward_context, override_forward_context
from tokenwise.layer_registry import get_layers_from_config
from tokenwise.layers.cpu_prepack import prepack_linear_weights
from tokenwise.loader import load_model
from tokenwise.model_config import ModelConfig

# Catch-up queries this long or shorter, after a context, run as decode rows (on CPU).
MAX_QUERY_AS_DECODE_ROWS = 16


@dataclass
class DraftSeq:
    """One sequence of a draft pass: `tokens` at positions `start..`, after `start` cached
    ones; `table` is its block table (target blocks, then its scratch blocks)."""

    tokens: np.ndarray  # int64, at least one token
    start: int
    table: np.ndarray  # int32
    sample: bool = True  # whether the token after the last one is wanted


@dataclass
class DraftPass:
    """One pass laid out: flat inputs (sequences in `order`), metadata by layer name, and
    the rows whose next token is wanted (one per sampling sequence, in layout order)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: dict[str, AttentionMetadata]
    sample_rows: torch.Tensor
    order: list[int]  # layout slot -> index in the caller's list
    samples: list[bool]  # per layout slot

    def in_seq_order(self, picked: list[Any]) -> list[Any]:
        """Per-sampling-row results (layout order) back in the caller's order."""
        it = iter(picked)
        by_seq = {self.order[r]: next(it) for r, wanted in enumerate(self.samples) if wanted}
        return [by_seq[i] for i in sorted(by_seq)]


def draft_engine_config(target: EngineConfig, draft_dir: str) -> EngineConfig:
    """The draft's own config: its checkpoint in the target's dtype, length and block size,
    eager, on one rank (under DP each rank's engine has a draft of its own)."""
    assert target.model is not None
    try:
        model = ModelConfig.from_pretrained(
            draft_dir,
            dtype=target.model.dtype,
            max_model_len=target.model.max_model_len,
            device=target.device,
            seed=target.model.seed,
            skip_tokenizer_init=True,
        )
    except (ValueError, OSError) as exc:
        raise ValueError(f"speculative_config.model {draft_dir!r}: {exc}") from exc
    if model.vocab_size != target.model.vocab_size:
        raise ValueError(
            f"speculative_config.model {draft_dir!r} has vocab_size {model.vocab_size}, but the "
            f"target's is {target.model.vocab_size}: a draft model must share the target's "
            "tokenizer and vocabulary"
        )
    return EngineConfig(
        model=model,
        parallel=ParallelConfig(is_moe_model=False),
        compilation=CompilationConfig(),
        cache=CacheConfig(block_size=target.cache.block_size),
        scheduler=dataclasses.replace(target.scheduler),
        device=target.device,
    )


class DraftRunner:
    def __init__(
        self,
        target: EngineConfig,
        draft_dir: str,
        device: str | torch.device = "cpu",
    ) -> None:
        """Load the draft; its cache comes later (`allocate`), once the engine's KV sizing
        has counted it (`kv_bytes_per_block`) in the same budget as the target's."""
        if target.parallel.tensor_parallel_size > 1:
            raise ValueError(
                "speculative_config.model: a draft model does not run under "
                f"tensor_parallel_size={target.parallel.tensor_parallel_size} yet (use data "
                "parallelism, where each rank runs its own draft, or method 'ngram')"
            )
        self.config = draft_engine_config(target, draft_dir)
        self.device = torch.device(device)
        self.block_size = target.cache.block_size
        self.num_blocks = 0
        self.vocab_size = target.model.vocab_size if target.model is not None else 0
        self.model = self._load_model(draft_dir)
        if self.device.type == "cpu":
            prepack_linear_weights(self.model)
        layers = get_layers_from_config(self.config, AttentionLayerBase)
        for name, layer in layers.items():
            kind = getattr(layer, "attn_type", AttentionType.DECODER)
            if kind is not AttentionType.DECODER or not layer.needs_kv_cache:
                raise ValueError(
                    f"speculative_config.model {draft_dir!r}: layer {name} is {kind.value} "
                    "attention; a draft model must be a decoder-only language model"
                )
        if not layers:
            raise ValueError(f"speculative_config.model {draft_dir!r} has no attention layers")
        self.layers = layers
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._decode_rows_ok = self.device.type == "cpu" and all(
            type(layer) is Attention for layer in layers.values()
        )
        # Layers with the same spec (sliding window) share one metadata object per pass.
        self._spec_of = {name: layer.sliding_window for name, layer in layers.items()}
        self._builders = {
            spec: CommonMetadataBuilder(self.block_size, spec, self.device)
            for spec in set(self._spec_of.values())
        }

    def kv_bytes_per_block(self) -> int:
        """What one block of the draft's cache costs, over all its layers (its KV group)."""
        itemsize = self.config.model.dtype.itemsize
        total = 0
        for layer in self.layers.values():
            one, two = (math.prod(layer.kv_cache_shape(n, self.block_size)) for n in (1, 2))
            total += (two - one) * itemsize
        return total

    def allocate(self, num_blocks: int, num_scratch_blocks: int) -> None:
        """The draft's cache: the target pool's `num_blocks` (same ids), then its scratch."""
        self.num_blocks = num_blocks
        dtype = self.config.model.dtype
        for name, layer in self.layers.items():
            shape = layer.kv_cache_shape(num_blocks + num_scratch_blocks, self.block_size)
            cache = torch.zeros(shape, dtype=dtype, device=self.device)
            self.kv_caches[name] = cache
            layer.kv_cache = [cache]

    def _load_model(self, draft_dir: str) -> torch.nn.Module:
        """The draft's weights (an EAGLE runner builds its head here instead)."""
        return load_model(self.config, self.device)

    @torch.inference_mode()
    def run(self, seqs: list[DraftSeq]) -> list[int]:
        """One forward pass over `seqs`; the greedy next token of each sequence that samples,
        in the order of `seqs`."""
        p = self.lay_out(seqs)
        # A context of its own: the draft's layers, its metadata; no DP coordination (the
        # draft is local to this rank) and no entry in the target's per-batch-size timings.
        with override_forward_context(create_forward_context(p.metadata, self.config)):
            hidden = self.model(p.input_ids, p.positions)
        if not p.sample_rows.numel():
            return []
        logits = self.model.compute_logits(hidden.index_select(0, p.sample_rows))
        return p.in_seq_order(logits[:, : self.vocab_size].argmax(dim=-1).tolist())

    def lay_out(self, seqs: list[DraftSeq]) -> DraftPass:
        """A pass's inputs and attention metadata, its sequences laid out prefills first."""
        # Prefills (more than one token) first, as the attention metadata wants them.
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].tokens) == 1)
        ordered = [seqs[i] for i in order]
        query = np.array([len(s.tokens) for s in ordered], dtype=np.int64)
        context = np.array([s.start for s in ordered], dtype=np.int64)
        seq_lens = context + query
        input_ids = np.concatenate([s.tokens for s in ordered])
        positions = np.concatenate([np.arange(s.start, s.start + len(s.tokens)) for s in ordered])
        bs = self.block_size
        slots = np.concatenate(
            [
                s.table[np.arange(s.start, s.start + len(s.tokens)) // bs].astype(np.int64) * bs
                + np.arange(s.start, s.start + len(s.tokens)) % bs
                for s in ordered
            ]
        )
        width = int(-(-seq_lens.max() // bs))
        tables = np.zeros((len(ordered), width), dtype=np.int32)
        for row, (s, n) in enumerate(zip(ordered, seq_lens.tolist(), strict=True)):
            used = -(-n // bs)
            tables[row, :used] = s.table[:used]
        if self._as_decode_rows(query, context):
            # One decode row per token, the i-th seeing its own position + 1 keys: the CPU
            # backend writes all of a pass's K/V before it attends, so this is the same
            # causal attention, through the decode kernel instead of the prefill path.
            owner = np.repeat(np.arange(len(ordered)), query)
            metadata = self._metadata(positions + 1, np.ones_like(positions), slots, tables[owner])
        else:
            metadata = self._metadata(seq_lens, query, slots, tables)
        dev = self.device
        cu = np.cumsum(query)
        rows = [int(cu[r]) - 1 for r, s in enumerate(ordered) if s.sample]
        return DraftPass(
            torch.from_numpy(input_ids).to(dev),
            torch.from_numpy(positions.astype(np.int64)).to(dev),
            metadata,
            torch.tensor(rows, dtype=torch.int64, device=dev),
            order,
            [s.sample for s in ordered],
        )

    def _as_decode_rows(self, query: np.ndarray, context: np.ndarray) -> bool:
        """Whether a pass's short queries after a context run as decode rows (CPU only, as
        `runner.verify_rows` does for the target): the draft's catch-up after a step is such
        a pass, and the prefill path costs it about twice as much."""
        longer = query > 1
        return (
            self._decode_rows_ok
            and bool(longer.any())
            and int(query.max()) <= MAX_QUERY_AS_DECODE_ROWS
            and bool(context[longer].all())
        )

    def _metadata(
        self, seq_lens: np.ndarray, query: np.ndarray, slots: np.ndarray, tables: np.ndarray
    ) -> dict[str, AttentionMetadata]:
        """One metadata object per attention spec (untrimmed tables: a sliding window then
        applies by masking), keyed by layer name."""
        dev = self.device
        slot_mapping = torch.from_numpy(slots).to(dev)
        seq_lens_tensor = torch.from_numpy(seq_lens.astype(np.int32)).to(dev)
        block_tables = torch.from_numpy(tables).to(dev)
        by_spec = {}
        for spec, builder in self._builders.items():
            builder.prepare()
            by_spec[spec] = builder.build(
                seq_lens,
                query,
                slot_mapping=slot_mapping,
                seq_lens_tensor=seq_lens_tensor,
                block_tables=block_tables,
            )
        return {name: by_spec[spec] for name, spec in self._spec_of.items()}


__all__ = ["DraftPass", "DraftRunner", "DraftSeq", "draft_engine_config"]
