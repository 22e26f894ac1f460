"""The vision tower's budget per step: at most `max_num_encoder_input_tokens` image tokens
encoded in one step (vLLM's name and default, `max_num_batched_tokens`).

The tower runs in the step whose prefill chunk first reaches an image the runner's encoder
cache does not hold (`multimodal_runner.py`). Without a bound, a step that admits many image
prompts at once runs the tower on all their images before its forward pass, and that step's
latency (and the decodes that share it) grows with the number of images. So the scheduler
counts, chunk by chunk, the image tokens each step would encode, and a chunk that would pass
the budget stops just before the first image that does not fit: its prompt goes on there in
a later step (a chunk that would start on such an image gets nothing this step). A prompt
whose chunk cannot be cut (chunked prefill off) waits whole.

Never stuck: the first image a step encodes always runs, even one larger than the whole
budget, so every image runs in some step, alone if need be (and an uncuttable prompt runs all
its images when it is the first to encode in its step). (vLLM raises the budget at start-up
to the largest image a prompt may carry, which has the same effect for fixed-size images; images
of any size, as Qwen2.5-VL takes, would need a bound on their size first.)

To know which images need the tower, this mirrors the runner's encoder cache without its
tensors: which requests hold which image (by content hash). A request holds an image from
the chunk that first covers it until the chunk that reaches its end, or until it leaves the
batch; an image some request holds, or that another request encodes this same step, costs
nothing. The runner takes and lets go of its entries by exactly these rules, one step later
in time but in the same order, so both agree on what a step encodes (the tests spy on the
tower to check it).
"""

from __future__ import annotations

from typing import Any

from tokenwise.engine.kinds.image_holds import ImageHolds


class EncoderBudget:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._holds = ImageHolds()
        self._step: dict[bytes, tuple[str, int]] = {}  # encoded this step: (request, tokens)
        self.spent = 0  # image tokens this step encodes

    def begin_step(self) -> None:
        self._step.clear()
        self.spent = 0

    def limit(self, request: Any, start: int, num_new: int, may_cut: bool) -> int:
        """How many of the chunk's `num_new` tokens from `start` fit the step's budget: all,
        or up to the first image that does not fit (0: none; always 0 without `may_cut`)."""
        end = start + num_new
        rid = request.request_id
        # A chunk that cannot be cut runs all its images when it is the step's first to encode.
        whole = not may_cut and self.spent == 0
        for image in getattr(request, "images", ()):
            if image.end <= start or image.offset >= end:
                continue
            key = image.content_hash
            if self._holds.is_held(key) or key in self._step:
                continue  # cached, or encoded for another chunk of this step
            if whole or self.spent == 0 or self.spent + image.length <= self.max_tokens:
                self._step[key] = (rid, image.length)
                self.spent += image.length
                continue
            if not may_cut or image.offset <= start:
                self.forget(rid)
                return 0
            return image.offset - start
        return num_new

    def forget(self, request_id: str) -> None:
        """Take back what `request_id` was to encode this step (it is not scheduled)."""
        for key, (rid, tokens) in list(self._step.items()):
            if rid == request_id:
                del self._step[key]
                self.spent -= tokens

    def commit(self, scheduled: list[Any]) -> None:
        """The step is final: each scheduled chunk takes the images it covers and lets go of
        those it finishes (takes first, then lets go: the runner's order)."""
        for item in scheduled:
            req = item.request
            start = req.num_computed_tokens
            end = start + item.num_new_tokens
            rid = req.request_id
            finished = []
            for image in getattr(req, "images", ()):
                if image.end <= start or image.offset >= end:
                    continue
                self._holds.hold(rid, image.content_hash)
                if end >= image.end:
                    finished.append(image.content_hash)
            for key in finished:
                self._holds.release(rid, key)

    def release_request(self, request_id: str) -> None:
        """`request_id` left the batch (finished, aborted, preempted): it holds nothing."""
        self.forget(request_id)
        for key in self._holds.keys_of(request_id):
            self._holds.release(request_id, key)

    def num_held(self) -> int:
        """Images some request holds (0 once every prefill is past its images)."""
        return len(self._holds)
