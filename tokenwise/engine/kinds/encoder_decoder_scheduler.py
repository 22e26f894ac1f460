"""The scheduler of an encoder-decoder model: the decoder's, plus each request's encoder.

An encoder-decoder request runs its whole encoder in the step that admits it (again after a
preemption): its encoder tokens share that step's token budget with the decoder's, and its
cross-attention K/V need the blocks of the block manager's CROSS_ATTN group, allocated whole
at admission and freed with the request. Everything else (chunked decoder prompts, decoding,
preemption, stop rules) is the generative scheduler's.
"""

from __future__ import annotations

from tokenwise.engine.kinds.requests import EncoderDecoderRequest
from tokenwise.engine.request import Request
from tokenwise.engine.scheduler import Scheduler


class EncoderDecoderScheduler(Scheduler):
    def add_request(self, request: Request) -> None:
        """Refuse an encoder that cannot run in one step with a decoder token; then as usual."""
        num_encoder = self.admission_tokens(request)
        if num_encoder + 1 > self.config.max_num_batched_tokens:
            raise ValueError(
                f"the encoder input has {num_encoder} tokens, which must run in one step with "
                f"at least one decoder token: more than max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens}; raise it or shorten the encoder input"
            )
        super().add_request(request)

    def admission_tokens(self, request: Request) -> int:
        return _encoder_request(request).num_encoder_tokens

    def admission_blocks(self, request: Request) -> int:
        return -(-self.admission_tokens(request) // self.block_manager.block_size)

    def allocate_admission_blocks(self, request: Request) -> list[int] | None:
        return self.block_manager.allocate_cross_slots(
            request.request_id, self.admission_tokens(request)
        )


def _encoder_request(request: Request) -> EncoderDecoderRequest:
    if not isinstance(request, EncoderDecoderRequest):
        raise TypeError(
            f"an encoder-decoder model serves EncoderDecoderRequest, got {type(request).__name__}"
        )
    return request
