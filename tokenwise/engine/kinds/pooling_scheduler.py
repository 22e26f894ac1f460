"""The scheduler of an embedding model: whole prompts, admitted in arrival order, one step each.

A bidirectional encoder needs every token of a prompt in the same pass (token 0 attends to the
last one), so a prompt is never chunked: one longer than the step's token budget
(`max_num_batched_tokens`) or than `max_model_len` is refused when it is added, with an error
that says which limit to raise. Every other prompt fits an empty step, so the head of the queue
always runs at the next step: no request waits forever. A request finishes in the step that
encodes it (`update_from_output`), and there are no KV blocks to allocate or free.
"""

from __future__ import annotations

from tokenwise.engine.request import Request, RequestStatus
from tokenwise.engine.scheduler import Scheduler
from tokenwise.engine.step_outputs import ScheduledRequest, SchedulerOutput


class PoolingScheduler(Scheduler):
    def add_request(self, request: Request) -> None:
        n = request.num_tokens
        if n > self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens, more than max_model_len={self.max_model_len}; an "
                "encoder reads a whole prompt at once, so shorten the input"
            )
        budget = self.config.max_num_batched_tokens
        if n > budget:
            raise ValueError(
                f"prompt has {n} tokens, more than max_num_batched_tokens={budget}; an encoder "
                "cannot split a prompt across steps, so raise max_num_batched_tokens or "
                "shorten the input"
            )
        request.status = RequestStatus.WAITING
        self.waiting.add_request(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        while self.waiting and len(out.scheduled) < self.config.max_num_seqs:
            req = self.waiting.peek_request()
            if req.num_tokens > budget:
                break
            self.waiting.pop_request()
            req.status = RequestStatus.RUNNING
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = 0
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, req.num_tokens))
            budget -= req.num_tokens
        # A one-token prompt counts as a "decode" row in the attention metadata, which wants
        # every prefill before the decodes; the order within a step changes no result.
        out.scheduled.sort(key=lambda item: item.num_new_tokens == 1)
        if not out.is_empty:
            out.finished_req_ids, self._left_since_last_step = self._left_since_last_step, []
            out.send_new_requests(set())  # every request runs once: each is new to the runner
        return out
