"""Suffix decoding: drafts from what followed the request's latest tokens, weighted by frequency.

N-gram lookup copies what followed the single most recent match of a fixed-size window.
Suffix decoding (vLLM's method "suffix", after Arctic Inference's SuffixDecoding paper, arXiv
2411.04975) keeps a counted suffix tree (`suffix_tree.SuffixTree`) of each request's prompt and
output, and another of the outputs of the last `max_cached_requests` finished requests, so it
sees every earlier occurrence at once and:

- follows the most frequent continuation token by token, estimating each draft's probability
  as the product of the branch frequencies along the way, and stops once that falls under
  `min_token_prob` (a pattern that was followed by different things proposes little);
- proposes a variable number of drafts, at most `max_spec_factor` times the match length
  (a long match is strong evidence the text is repeating) and at most the room the tree's
  depth leaves below the match;
- of the candidates from every match length in both trees, keeps the one with the highest
  score, the sum of its drafts' probabilities (its expected number of accepted tokens).

Updates are incremental: a step appends only the request's new tokens to its tree
(O(max_tree_depth) each) and follows them through the shared cache with a `Matcher`. A finished
request's output joins the cache; the oldest is taken out when more than `max_cached_requests`
are held. No model, no KV cache: the drafts are verified like any others, so the output is
exactly what the target model samples.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from tokenwise.spec_decode.suffix_tree import BEST, CHILDREN, COUNT, Matcher, Node, SuffixTree


class _RequestState:
    """A request's own tree and its place in the shared cache."""

    __slots__ = ("tree", "matcher", "cache_version")

    def __init__(self, depth: int, cache: SuffixTree | None) -> None:
        self.tree = SuffixTree(depth)
        self.matcher = Matcher(cache) if cache is not None else None
        self.cache_version = -1


class SuffixProposer:
    """Proposes up to `num_speculative_tokens` drafts per request from suffix trees."""

    def __init__(
        self,
        num_speculative_tokens: int,
        max_tree_depth: int = 24,
        max_cached_requests: int = 100,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if max_tree_depth < 2:
            raise ValueError(f"suffix_decoding_max_tree_depth must be >= 2, got {max_tree_depth}")
        self.k = num_speculative_tokens
        self.depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._requests: dict[str, _RequestState] = {}
        self._cache = SuffixTree(max_tree_depth) if max_cached_requests > 0 else None
        self._cached: OrderedDict[str, list[int]] = OrderedDict()
        self._cache_version = 0

    @property
    def num_tracked(self) -> int:
        return len(self._requests)

    def propose(
        self, token_ids: np.ndarray, max_tokens: int | None = None, request_id: str = ""
    ) -> list[int]:
        """Drafts continuing request `request_id`, whose whole text is `token_ids` (prompt and
        output so far; it only ever grows between calls), at most `max_tokens` (default k)."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        state = self._sync(request_id, token_ids)
        if k <= 0:
            return []
        best: tuple[float, list[int]] = (0.0, [])
        own = state.tree.suffix_nodes()
        best = self._best_draft(own, k, best, own)
        if state.matcher is not None:
            best = self._best_draft(state.matcher.suffix_nodes(), k, best, None)
        return best[1]

    def finish(self, request_id: str, token_ids: list[int], prompt_len: int) -> None:
        """A request ended: its output (`token_ids[prompt_len:]`) joins the shared cache, the
        oldest cached outputs leave it, and the request's own tree is dropped."""
        self._requests.pop(request_id, None)
        output = list(token_ids[prompt_len:])
        if self._cache is None or not output:
            return
        old = self._cached.pop(request_id, None)
        if old is not None:
            self._cache.remove_sequence(old)
        self._cached[request_id] = output
        self._cache.add_sequence(output)
        while len(self._cached) > self.max_cached_requests:
            _, evicted = self._cached.popitem(last=False)
            self._cache.remove_sequence(evicted)
        self._cache_version += 1

    def forget(self, alive: set[str]) -> None:
        """Drop the trees of requests not in `alive` (ones that left without finishing)."""
        self._requests = {rid: s for rid, s in self._requests.items() if rid in alive}

    def _sync(self, request_id: str, token_ids: np.ndarray) -> _RequestState:
        """The request's state with its tree and cache matcher caught up to `token_ids`."""
        state = self._requests.get(request_id)
        total = len(token_ids)
        if state is None or state.tree.num_tokens > total:  # new, or restarted shorter
            state = self._requests[request_id] = _RequestState(self.depth, self._cache)
        have = state.tree.num_tokens
        if total > have:
            state.tree.extend(token_ids[have:].tolist())
        matcher = state.matcher
        if matcher is not None:
            if state.cache_version != self._cache_version:
                # The cache changed under the matcher: follow the text's last tokens afresh
                # (the suffixes it tracks depend on no more than max_tree_depth - 1 of them).
                matcher = state.matcher = Matcher(matcher.tree)
                matcher.num_tokens = max(0, total - (self.depth - 1))
                state.cache_version = self._cache_version
            if total > matcher.num_tokens:
                matcher.extend(token_ids[matcher.num_tokens :].tolist())
        return state

    def _best_draft(
        self,
        nodes: list[Node],
        k: int,
        best: tuple[float, list[int]],
        live: list[Node] | None,
    ) -> tuple[float, list[int]]:
        """The highest-scoring draft from the match nodes `nodes` (`nodes[i]` matched the
        text's last i + 1 tokens), or `best` if none beats it. `live` is the tree's own
        suffix nodes when the tree holds the text itself (its current end occurrence has no
        continuation yet, so it does not count towards the branch frequencies)."""
        depth, factor = self.depth, self.max_spec_factor
        for i in range(len(nodes) - 1, -1, -1):
            match_len = i + 1
            bound = min(k, int(match_len * factor), depth - match_len)
            if bound <= best[0]:
                continue  # even certain drafts could not score higher
            node = nodes[i]
            if not node[CHILDREN]:
                continue
            score, drafts = self._follow(node, match_len, bound, live)
            if score > best[0]:
                best = (score, drafts)
        return best

    def _follow(
        self, node: Node, match_len: int, limit: int, live: list[Node] | None
    ) -> tuple[float, list[int]]:
        """Up to `limit` drafts down the most frequent branches from `node`, while their
        estimated probability stays at or above `min_token_prob`; and their score."""
        drafts: list[int] = []
        prob, score, level = 1.0, 0.0, match_len
        min_prob = self.min_token_prob
        while len(drafts) < limit:
            token = node[BEST]
            if token < 0:
                break
            child = node[CHILDREN][token]
            total = node[COUNT]
            if live is not None and level <= len(live) and live[level - 1] is node:
                total -= 1  # this node's latest occurrence is the text's end: no successor yet
            if total <= 0:
                break
            prob *= min(1.0, child[COUNT] / total)
            if prob < min_prob:
                break
            drafts.append(token)
            score += prob
            node, level = child, level + 1
        return score, drafts


__all__ = ["SuffixProposer"]
