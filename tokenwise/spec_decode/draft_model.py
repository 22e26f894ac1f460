"""Draft-model speculation: a smaller model with the target's vocabulary proposes the drafts.

Each engine step, after the target has verified the last drafts, the draft model catches up on
the tokens its cache does not hold yet for every request that will verify drafts next step (the
tokens accepted this step and the one the target drew; the whole prompt the first time it sees
a request), in one forward pass for all of them, and takes the argmax after the last one as
draft 1. `k - 1` more one-token passes, each feeding the draft it just made, give drafts 2..k.

Draft sampling is greedy (argmax). Verification stays exact anyway: the proposal distribution
is then one-hot, `q(d) = 1` at the proposed token, which is what `rejection.verify` assumes
when it is given no draft probabilities; a rejected position draws from `max(p - q, 0)`, the
target with the draft token removed. So the output distribution is the target's, and greedy
output is token for token the target's greedy output.

The draft's K/V lives in its own cache, addressed by the target's block ids
(`draft_runner.DraftRunner`). What that cache holds for a request is tracked here, not
rolled back: after a step, positions before the previous proposal's sequence length are right
(the catch-up wrote them from known tokens), and so are the fed drafts that verification kept;
the first fed draft the request did not keep, and everything after it, is recomputed by the
next catch-up, which writes over it at the same slots. Positions the scheduler had not yet
allocated blocks for were written to per-request scratch blocks and are recomputed too. A
request seen for the first time or again after a preemption (new blocks, or prefix-cache hits
whose draft K/V nobody wrote) starts from position 0. Nothing the draft's cache holds can
change the output, only how many drafts are accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenwise.config import EngineConfig
from tokenwise.spec_decode.draft_runner import DraftRunner, DraftSeq


@dataclass
class DraftRequest:
    """What the proposer needs of one request: plain data, no engine types."""

    request_id: str
    token_ids: np.ndarray  # every known token (prompt and output), int64
    block_table: Sequence[int]  # the target's table for the request (covers the computed ones)
    num_drafts: int  # how many drafts it may verify next step (>= 1)
    generation: int = 0  # changes when the request restarts (a preemption): new blocks


@dataclass
class _Cached:
    """What the draft cache holds for one request since its last proposal."""

    generation: int
    known: int  # sequence length when it was proposed for: positions before it are right
    fed: list[int]  # the drafts fed at positions known, known + 1, ...
    limit: int  # positions from here on went to scratch blocks


class DraftModelProposer:
    """Proposes up to `num_speculative_tokens` greedy drafts per request with a draft model."""

    def __init__(self, target: EngineConfig, device: str | torch.device = "cpu") -> None:
        """Loads the draft; `allocate(num_blocks)` gives it its cache once KV sizing (which
        counts `kv_bytes_per_block` and `reserved_kv_bytes`) has fixed the pool."""
        spec = target.speculative
        if spec is None or (spec.model is None and spec.method != "mtp"):
            raise ValueError("DraftModelProposer needs speculative_config.model")
        self.k = spec.num_speculative_tokens
        self.block_size = target.cache.block_size
        self.max_seqs = target.scheduler.max_num_seqs
        # One pass holds at most a step's worth of tokens; a longer catch-up (a long prompt)
        # takes several passes.
        self.max_pass_tokens = target.scheduler.max_num_batched_tokens
        # Look-ahead positions reach k - 1 past the sequence, whose last token may already be
        # past the allocated blocks: at most this many blocks beyond them.
        self.scratch_per_seq = (self.k - 1) // self.block_size + 2
        self.num_scratch_blocks = self.scratch_per_seq * self.max_seqs
        self.runner = self._make_runner(target, device)
        self._cached: dict[str, _Cached] = {}

    def _make_runner(self, target: EngineConfig, device: str | torch.device) -> DraftRunner:
        """The runner of the draft's passes (an EAGLE proposer makes an EAGLE runner)."""
        assert target.speculative is not None and target.speculative.model is not None
        return DraftRunner(target, target.speculative.model, device)

    def kv_bytes_per_block(self) -> int:
        """The draft's K/V beside each block of the target's pool."""
        return self.runner.kv_bytes_per_block()

    def reserved_kv_bytes(self) -> int:
        """The draft's scratch blocks, outside the pool."""
        return self.num_scratch_blocks * self.runner.kv_bytes_per_block()

    def allocate(self, num_blocks: int) -> None:
        self.runner.allocate(num_blocks, self.num_scratch_blocks)

    def propose_batch(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Each request's drafts (`num_drafts` of them), with one catch-up pass and at most
        `k - 1` one-token passes for the whole batch."""
        if not requests:
            return []
        tables, lengths = self._tables(requests)
        drafts = [[tok] for tok in self._catch_up(requests, tables, lengths)]
        for j in range(1, max(r.num_drafts for r in requests)):
            active = [i for i, r in enumerate(requests) if r.num_drafts > j]
            seqs = [
                DraftSeq(np.array(drafts[i][-1:], dtype=np.int64), lengths[i] - 1 + j, tables[i])
                for i in active
            ]
            for i, tok in zip(active, self.runner.run(seqs), strict=True):
                drafts[i].append(tok)
        for req, n, proposed in zip(requests, lengths, drafts, strict=True):
            limit = len(req.block_table) * self.block_size
            self._cached[req.request_id] = _Cached(req.generation, n, proposed[:-1], limit)
        return drafts

    def _tables(self, requests: list[DraftRequest]) -> tuple[list[np.ndarray], list[int]]:
        """Each request's block table (its target blocks, then its scratch blocks) and its
        sequence length; a request whose drafts would not fit is an error."""
        if len(requests) > self.max_seqs:
            raise ValueError(f"{len(requests)} requests, more than max_num_seqs={self.max_seqs}")
        tables, lengths = [], []
        for row, req in enumerate(requests):
            table = np.asarray(req.block_table, dtype=np.int32)
            first = self.runner.num_blocks + row * self.scratch_per_seq
            scratch = np.arange(first, first + self.scratch_per_seq, dtype=np.int32)
            tables.append(np.concatenate([table, scratch]))
            n = len(req.token_ids)
            lengths.append(n)
            last = n - 2 + req.num_drafts  # the last position a fed draft is written at
            if req.num_drafts < 1 or last // self.block_size >= len(tables[-1]):
                raise ValueError(
                    f"request {req.request_id}: {req.num_drafts} drafts after {n} tokens do not "
                    f"fit its {len(table)} blocks and the draft's scratch blocks"
                )
        return tables, lengths

    def observe(self, target_hidden: object) -> None:
        """A draft model reads no target features (an EAGLE proposer keeps them)."""

    def pause(self, paused: bool) -> None:
        """Speculation is off for now (`disable_by_batch_size`); a draft model keeps nothing
        per step, so there is nothing to stop keeping."""

    @property
    def num_tracked(self) -> int:
        """How many requests' state is remembered (for the engine's clean-up)."""
        return len(self._cached)

    def forget(self, alive: set[str]) -> None:
        """Drop what is remembered of requests that left."""
        self._cached = {rid: c for rid, c in self._cached.items() if rid in alive}

    def cached_prefix(self, req: DraftRequest) -> int:
        """How many leading positions of `req` the draft cache holds right (at most all but
        the last token, whose pass gives draft 1)."""
        cached = self._cached.get(req.request_id)
        n = len(req.token_ids)
        if cached is None or cached.generation != req.generation or cached.known > n:
            return 0
        kept = 0
        tokens = req.token_ids
        while (
            kept < len(cached.fed)
            and cached.known + kept < n
            and int(tokens[cached.known + kept]) == cached.fed[kept]
        ):
            kept += 1
        return min(cached.known + kept, cached.limit, n - 1)

    def _catch_up(
        self, requests: list[DraftRequest], tables: list[np.ndarray], lengths: list[int]
    ) -> list[int]:
        """Run the draft over every token its cache lacks, in passes of at most
        `max_pass_tokens` tokens; the argmax after each request's last token."""
        pending = {i: self.cached_prefix(req) for i, req in enumerate(requests)}
        first: list[int] = [0] * len(requests)
        while pending:
            seqs, owners, budget = [], [], self.max_pass_tokens
            for i, pos in pending.items():
                if budget <= 0:
                    break
                take = min(lengths[i] - pos, budget)
                end = pos + take
                tokens = requests[i].token_ids[pos:end]
                seqs.append(DraftSeq(tokens, pos, tables[i], sample=end == lengths[i]))
                owners.append(i)
                budget -= take
            picked = iter(self.runner.run(seqs))
            for seq, i in zip(seqs, owners, strict=True):
                if seq.sample:
                    first[i] = next(picked)
                    del pending[i]
                else:
                    pending[i] = seq.start + len(seq.tokens)
        return first


__all__ = ["DraftModelProposer", "DraftRequest"]
