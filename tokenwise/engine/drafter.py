"""The engine's side of speculative decoding: which requests get drafts, and how many held.

After each step the engine asks the `Drafter` for the next step's drafts. It proposes for
requests about to decode (their next step computes one known token), within what they may
still emit (`max_tokens`, the model length), and nowhere while `disable_by_batch_size` or more
requests run: a step verifying `k` drafts for a large batch costs about `k + 1` decode steps
once the batch is compute-bound, so speculation then slows the engine down. Requests that may
not stop yet (`min_tokens`) get no drafts (their stop tokens are banned per token). Guided
requests do: the runner masks each draft position as the grammar stands after the drafts
before it, and the scheduler's matcher only ever accepts the tokens verification kept.

How many drafts each request may verify is its own `DraftBudget` (`spec_decode.draft_budget`):
it grows while drafts are accepted, shrinks when some are not, and falls to 0 for a while
when too few are, so text the proposer cannot predict decodes at plain speed.

The proposer is n-gram lookup or suffix decoding (one request at a time, from its token ids;
suffix decoding keeps a tree per request and is told when one finishes, so its output can
join the shared cache of earlier outputs), a draft model
(`spec_decode.draft_model`: one batch for all the requests that draft, which also needs each
request's block table, since the draft's KV cache is addressed by the target's block ids) or
an EAGLE head or MTP module (`spec_decode.eagle`: the same, plus the target's hidden states of every step,
which `record` hands it).

The proposals land on `Request.spec_token_ids`; the scheduler takes them into the next step,
the runner verifies them (`tokenwise.sampling.rejection`), and the scheduler keeps the accepted
ones. The `Drafter` then counts what was proposed and accepted (vLLM's `spec_decode_*` figures).
Each request's token ids are mirrored in a NumPy buffer that grows by the new tokens only, so a
proposal never converts the whole sequence again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from tokenwise.config import SPEC_MODEL_METHODS, SpeculativeConfig
from tokenwise.engine.request import Request, RequestStatus
from tokenwise.engine.stats import EngineStats
from tokenwise.engine.step_outputs import ModelRunnerOutput
from tokenwise.spec_decode.draft_budget import DraftBudget
from tokenwise.spec_decode.draft_model import DraftModelProposer, DraftRequest
from tokenwise.spec_decode.ngram import NgramProposer
from tokenwise.spec_decode.suffix import SuffixProposer


class Drafter:
    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        draft_model: DraftModelProposer | None = None,
        block_table: Callable[[str], Sequence[int]] | None = None,
    ) -> None:
        """`draft_model` (with `block_table`, a request id's target block table) for methods
        "draft_model", "eagle", "eagle3" and "mtp"; suffix decoding for "suffix", n-gram
        lookup otherwise."""
        self.config = config
        assert config.num_speculative_tokens is not None
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.draft_model = draft_model
        self.block_table = block_table
        if config.method in SPEC_MODEL_METHODS:
            if draft_model is None or block_table is None:
                raise ValueError(f"method {config.method!r} needs the draft model and block tables")
        elif config.method == "suffix":
            self.suffix = SuffixProposer(
                self.k,
                config.suffix_decoding_max_tree_depth,
                config.suffix_decoding_max_cached_requests,
                config.suffix_decoding_max_spec_factor,
                config.suffix_decoding_min_token_prob,
            )
        else:
            assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
            self.proposer = NgramProposer(
                self.k, config.prompt_lookup_min, config.prompt_lookup_max
            )
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, length)
        self.budget = DraftBudget(self.k)

    def propose(self, running: list[Request]) -> None:
        """Set `spec_token_ids` on the running requests that should verify drafts next step."""
        self._forget_left(running)
        limit = self.config.disable_by_batch_size
        paused = limit is not None and len(running) >= limit
        if self.draft_model is not None:
            self.draft_model.pause(paused)
        if paused:
            return
        chosen: list[tuple[Request, int]] = []
        for req in running:
            room = self._room(req)
            if room <= 0:
                continue
            room = min(room, self.budget.limit(req.request_id))
            if room <= 0:
                continue
            chosen.append((req, room))
        if self.draft_model is not None and chosen:
            self._propose_with_draft_model(chosen)
        elif self.config.method == "suffix":
            for req, room in chosen:
                tokens = self._token_array(req)
                req.spec_token_ids = self.suffix.propose(tokens, room, req.request_id)
        else:
            for req, room in chosen:
                req.spec_token_ids = self.proposer.propose(self._token_array(req), room)

    def _forget_left(self, running: list[Request]) -> None:
        """Drop what is kept of requests that are no longer running (now and then)."""
        tracked = max(len(self._tokens), len(self.budget))
        if self.draft_model is not None:  # an EAGLE head keeps every request's features
            tracked = max(tracked, self.draft_model.num_tracked)
        if self.config.method == "suffix":
            tracked = max(tracked, self.suffix.num_tracked)
        if tracked > 2 * len(running) + 16:  # forget requests that left
            alive = {r.request_id for r in running}
            self._tokens = {rid: v for rid, v in self._tokens.items() if rid in alive}
            self.budget.forget(alive)
            if self.draft_model is not None:
                self.draft_model.forget(alive)
            if self.config.method == "suffix":
                self.suffix.forget(alive)

    def _propose_with_draft_model(self, chosen: list[tuple[Request, int]]) -> None:
        """One draft-model batch for every request that drafts this step."""
        assert self.draft_model is not None and self.block_table is not None
        batch = [
            DraftRequest(
                req.request_id,
                self._token_array(req),
                self.block_table(req.request_id),
                room,
                req.num_preemptions,
            )
            for req, room in chosen
        ]
        for (req, _), drafts in zip(chosen, self.draft_model.propose_batch(batch), strict=True):
            req.spec_token_ids = drafts

    def _room(self, req: Request) -> int:
        """How many drafts `req` may verify next step (0: none)."""
        if (
            req.status != RequestStatus.RUNNING
            or req.num_computed_tokens != req.num_tokens - 1
            or req.num_output_tokens < req.sampling_params.min_tokens
        ):
            return 0
        room = min(self.k, self.max_model_len - req.num_tokens)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - req.num_output_tokens - 1)
        return room

    def _token_array(self, req: Request) -> np.ndarray:
        """`req.all_token_ids` as an int64 array, copying only the tokens new since last time."""
        tokens = req.all_token_ids
        buf, have = self._tokens.get(req.request_id, (None, 0))
        if buf is None or have > len(tokens):  # new, or restarted shorter
            buf, have = np.empty(max(2 * len(tokens), 64), dtype=np.int64), 0
        if len(tokens) > len(buf):
            grown = np.empty(2 * len(tokens), dtype=np.int64)
            grown[:have] = buf[:have]
            buf = grown
        if len(tokens) > have:
            buf[have : len(tokens)] = tokens[have:]
        self._tokens[req.request_id] = (buf, len(tokens))
        return buf[: len(tokens)]

    def record(self, result: ModelRunnerOutput, stats: EngineStats) -> None:
        """Count the step's drafts and how many of them each request kept; hand an EAGLE
        head the target features the step computed."""
        if result.target_hidden is not None and self.draft_model is not None:
            self.draft_model.observe(result.target_hidden)
        for item, tokens in zip(result.sampled_requests, result.sampled_token_ids, strict=True):
            if item.request.status.is_finished:
                self._finished(item.request)  # its budget goes too: nothing more to observe
            elif item.spec_token_ids:
                self.budget.observe(
                    item.request.request_id, len(item.spec_token_ids), len(tokens) - 1
                )
            num_drafts = len(item.spec_token_ids)
            if not num_drafts:
                continue
            accepted = len(tokens) - 1
            stats.spec_decode_num_drafts += 1
            stats.spec_decode_num_draft_tokens += num_drafts
            stats.spec_decode_num_accepted_tokens += accepted
            per_pos = stats.spec_decode_num_accepted_tokens_per_pos
            if len(per_pos) < self.k:
                per_pos.extend([0] * (self.k - len(per_pos)))
            for pos in range(accepted):
                per_pos[pos] += 1

    def _finished(self, req: Request) -> None:
        """A request ended: suffix decoding caches its output; its state here is dropped."""
        rid = req.request_id
        if self.config.method == "suffix":
            self.suffix.finish(rid, req.all_token_ids, req.num_prompt_tokens)
        self._tokens.pop(rid, None)
        self.budget.drop(rid)


__all__ = ["Drafter"]
