"""EAGLE speculation: a one-layer head proposes drafts from the target's own hidden states.

The head at position `p` reads the token at `p + 1` and the target's features at `p` (its last
hidden state for EAGLE-1, three layers' inputs fused by `fc` for EAGLE-3) and predicts the
token at `p + 2`. So for a request of `n` known tokens, of which the target has computed the
first `n - 1`, the head catches up over positions `known .. n - 2` from the target's features
(`known`: where its own KV cache stops being right), and its prediction after position `n - 2`
is draft 1. Each further draft feeds the one before at the next position, with the head's own
output row in place of the target's features, as vLLM's proposer does (greedy, argmax).

The target's features come from the runner after every step (`runner.target_hidden`), for
every token it computed: prompt chunks, decodes and verified drafts alike. They are kept per
request until the head has consumed them; a step's rows start at the request's computed count
before the step, which cuts off the rows of drafts the step before rejected. The head's K/V
for positions the drafts were fed at is never right (the target's features there replace the
head's guesses), so every catch-up starts at `n - 1` of the proposal before: that is the
rollback. A request restarted by a preemption starts again from its first recomputed position;
positions no step computed (prefix-cache hits) have no features, and the head starts after them,
attending to whatever K/V its cache holds at their slots; the same holds for the steps run
while speculation was off (`disable_by_batch_size`), for which no features are kept. None of
this can change the output,
only how many drafts are accepted: verification is exact (`tokenwise.sampling.rejection`).

The K/V cache, its addressing by the target's block ids, scratch blocks for look-ahead
positions and the batching of passes are the draft model's (`draft_model`, `draft_runner`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.spec_decode.draft_model import DraftModelProposer, DraftRequest
from tokenwise.spec_decode.draft_runner import DraftRunner, DraftSeq
from tokenwise.spec_decode.eagle_runner import EagleRunner


@dataclass
class _Features:
    """One request's target features not yet consumed by the head."""

    generation: int
    known: int  # the head's K/V is right for positions before this
    start: int  # the position of rows[0]
    rows: torch.Tensor


class EagleProposer(DraftModelProposer):
    """Proposes up to `num_speculative_tokens` greedy drafts per request with an EAGLE head."""

    def __init__(
        self,
        target: EngineConfig,
        target_model: nn.Module,
        device: str | torch.device = "cpu",
    ) -> None:
        self._target_model = target_model
        super().__init__(target, device)
        self._features: dict[str, _Features] = {}
        self._paused = False

    def _make_runner(self, target: EngineConfig, device: str | torch.device) -> DraftRunner:
        return EagleRunner(target, self._target_model, device)

    @property
    def aux_layers(self) -> tuple[int, ...] | None:
        """The target layers whose inputs the head reads (None: the last hidden state)."""
        assert isinstance(self.runner, EagleRunner)
        return self.runner.aux_layers

    def pause(self, paused: bool) -> None:
        """While speculation is off (`disable_by_batch_size`: a large batch) keep no features:
        a large batch's would be the most memory, for drafts nobody asks for. When it resumes,
        each request's head starts at the first position it gets features for again."""
        if paused and not self._paused:
            self._features.clear()
        self._paused = paused

    def observe(self, target_hidden: object) -> None:
        """Keep a step's target features (`runner.target_hidden.TargetHidden`) per request."""
        if self._paused:
            return
        rows_all = target_hidden.rows  # type: ignore[attr-defined]
        for span in target_hidden.spans:  # type: ignore[attr-defined]
            rows = rows_all[span.offset : span.offset + span.count].clone()
            held = self._features.get(span.request_id)
            if held is None or held.generation != span.generation:
                self._features[span.request_id] = _Features(span.generation, 0, span.start, rows)
                continue
            end = held.start + held.rows.shape[0]
            if not held.start <= span.start <= end:  # a gap: keep the new rows only
                held.start, held.rows = span.start, rows
            else:  # drop rows from span.start on (rejected drafts), then append
                held.rows = torch.cat([held.rows[: span.start - held.start], rows])

    def forget(self, alive: set[str]) -> None:
        self._features = {rid: f for rid, f in self._features.items() if rid in alive}

    @property
    def num_tracked(self) -> int:
        return len(self._features)

    def propose_batch(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Each request's drafts (`num_drafts`, or none when the target's features for its
        last computed position are missing)."""
        if not requests:
            return []
        assert isinstance(self.runner, EagleRunner)
        tables, lengths = self._tables(requests)
        # Head positions to catch up on: from `first` through n - 2.
        pending: dict[int, int] = {}
        for i, req in enumerate(requests):
            held = self._features.get(req.request_id)
            n = lengths[i]
            if held is None or held.generation != req.generation:
                continue
            if held.start + held.rows.shape[0] < n - 1:  # the last computed position's row
                continue
            first = max(held.known, held.start)
            if first <= n - 2:
                pending[i] = first
        drafts: list[list[int]] = [[] for _ in requests]
        fed: dict[int, torch.Tensor] = {}
        while pending:
            seqs, feats, owners, budget = [], [], [], self.max_pass_tokens
            for i, pos in pending.items():
                if budget <= 0:
                    break
                req, n = requests[i], lengths[i]
                held = self._features[req.request_id]
                end = pos + min(n - 1 - pos, budget)  # head positions pos .. end - 1
                tokens = req.token_ids[pos + 1 : end + 1]
                seqs.append(DraftSeq(tokens, pos, tables[i], sample=end == n - 1))
                feats.append(self.runner.combine(held.rows[pos - held.start : end - held.start]))
                owners.append(i)
                budget -= end - pos
            picked, rows = self.runner.run_head(seqs, feats)
            sampling = iter(zip(picked, rows, strict=True))
            for seq, i in zip(seqs, owners, strict=True):
                if seq.sample:
                    token, row = next(sampling)
                    drafts[i].append(token)
                    fed[i] = row
                    del pending[i]
                else:
                    pending[i] = seq.start + len(seq.tokens)
        for j in range(1, max(r.num_drafts for r in requests)):
            active = [i for i in fed if requests[i].num_drafts > j]
            if not active:
                break
            seqs = [
                DraftSeq(np.array(drafts[i][-1:], dtype=np.int64), lengths[i] - 2 + j, tables[i])
                for i in active
            ]
            picked, rows = self.runner.run_head(seqs, [fed[i] for i in active])
            for i, token, row in zip(active, picked, rows, strict=True):
                drafts[i].append(token)
                fed[i] = row
        for i in fed:  # consumed through n - 2; the drafts' K/V is recomputed next time
            held = self._features[requests[i].request_id]
            cut = lengths[i] - 1
            held.rows = held.rows[cut - held.start :]
            held.start = held.known = cut
        return drafts


__all__ = ["EagleProposer"]
