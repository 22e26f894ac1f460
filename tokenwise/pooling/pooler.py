"""Turn a step's hidden states into one embedding per sequence: CLS, MEAN or LAST, then
optionally L2-normalised.

The runner hands over the flat hidden states of the whole step (every sequence concatenated,
as the model saw them) and each sequence's length; an encoder step holds whole prompts only,
so a sequence's tokens are exactly its prompt, [CLS] ... [SEP] included, which is what
sentence-transformers averages over.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tokenwise.config import PoolerConfig


class Pooler:
    """Pools with a resolved `PoolerConfig` (both fields set); per-request normalize wins."""

    def __init__(self, config: PoolerConfig) -> None:
        if config.pooling_type is None or config.normalize is None:
            raise ValueError(f"the pooler needs a resolved PoolerConfig, got {config}")
        self.pooling_type = config.pooling_type
        self.normalize = config.normalize

    def __call__(
        self,
        hidden_states: torch.Tensor,
        seq_lens: Sequence[int],
        normalize: Sequence[bool | None] | None = None,
    ) -> torch.Tensor:
        """`[num_seqs, hidden]` float32 embeddings of the sequences laid out back to back."""
        lens = torch.tensor(list(seq_lens), dtype=torch.int64, device=hidden_states.device)
        ends = torch.cumsum(lens, 0)
        starts = ends - lens
        hidden = hidden_states[: int(ends[-1])].float() if len(seq_lens) else hidden_states
        if self.pooling_type == "CLS":
            pooled = hidden.index_select(0, starts)
        elif self.pooling_type == "LAST":
            pooled = hidden.index_select(0, ends - 1)
        else:  # MEAN over each sequence's tokens
            owner = torch.repeat_interleave(torch.arange(len(seq_lens), device=lens.device), lens)
            sums = hidden.new_zeros(len(seq_lens), hidden.shape[-1]).index_add_(0, owner, hidden)
            pooled = sums / lens[:, None].to(sums.dtype)
        flags = [self.normalize if n is None else n for n in (normalize or [None] * len(lens))]
        if any(flags):
            rows = torch.tensor(flags, device=pooled.device)
            pooled = torch.where(rows[:, None], F.normalize(pooled, p=2, dim=-1), pooled)
        return pooled
