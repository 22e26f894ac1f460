"""N-gram prompt lookup: draft tokens copied from earlier in the request's own text.

When a sequence's last `n` tokens occurred before (in the prompt or the output so far), the
tokens that followed that earlier occurrence are a cheap guess at what comes next. Code being
repeated or edited, quotes, and structured data make such guesses right often; the target
model then verifies all of them in one forward pass (`tokenwise.sampling.rejection`).

The search finds every earlier occurrence of the last token, then extends all of them backwards
at once (one vectorised NumPy step per token of the window, at most `max_n`), and takes the
most recent of the longest matches if it is at least `min_n` tokens long. A match close to the
end (a repeating pattern) is extended periodically, so it still yields `k` drafts. No Python loop over
positions: a 4k-token sequence costs tens of microseconds. No model, no KV cache, no state beyond the token ids.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes up to `num_speculative_tokens` drafts per sequence by prompt lookup."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}"
            )
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: np.ndarray, max_tokens: int | None = None) -> list[int]:
        """Drafts continuing `token_ids` (1-D int array), at most `max_tokens` (default k).

        Empty when no window of `min_n`..`max_n` tokens ending the sequence occurred before.
        """
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        total = len(token_ids)
        if k <= 0 or total <= self.min_n:
            return []
        # End positions of earlier occurrences of the last token, then how far back each
        # candidate keeps matching the sequence's suffix (at most max_n tokens).
        ends = np.flatnonzero(token_ids[: total - 1] == token_ids[total - 1])
        if ends.size == 0:
            return []
        length = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for j in range(1, min(self.max_n, total - 1)):
            before = ends - j
            ok = alive & (before >= 0)
            ok[ok] = token_ids[before[ok]] == token_ids[total - 1 - j]
            length += ok
            alive = ok
            if not alive.any():
                break
        best = int(length.max())
        if best < self.min_n:
            return []
        # The most recent of the longest matches. What followed it runs up to the end of the
        # sequence; a match only `period` tokens back (a repeating pattern) is continued
        # periodically, as the text would go on if it kept repeating.
        start = int(ends[np.flatnonzero(length == best)[-1]]) + 1
        period = total - start
        return token_ids[start + np.arange(k) % period].tolist()
        return []

    def propose_batch(
        self, sequences: list[np.ndarray], max_tokens: list[int] | None = None
    ) -> list[list[int]]:
        """`propose` for each sequence (with its own cap, when given)."""
        if max_tokens is None:
            return [self.propose(seq) for seq in sequences]
        return [self.propose(seq, cap) for seq, cap in zip(sequences, max_tokens, strict=True)]


__all__ = ["NgramProposer"]
