"""`POST /v1/completions`: text in, text out, for one prompt or a batch of prompts.

Every prompt of a batch becomes its own engine request (they share steps like any other
requests); choice `i * n + j` is sample `j` of prompt `i`, as in OpenAI's and vLLM's servers.
Text prompts are tokenized by the engine client, with the tokenizer's special tokens (BOS);
`add_special_tokens: false` tokenizes them here without, for prompts that carry their own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenwise.engine.prompts import check_text
from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.logprobs import completion_logprobs
from tokenwise.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from tokenwise.entrypoints.openai.serving_common import (
    OpenAIServing,
    build_sampling_params,
    check_cap,
)
from tokenwise.entrypoints.openai.structured_outputs import guided_decoding_for
from tokenwise.outputs import CompletionOutput
from tokenwise.sampling.params import SamplingParams

if TYPE_CHECKING:
    from tokenwise.engine.prompts import PromptInput


def _prompts(prompt: str | list) -> list[PromptInput]:
    """OpenAI's four prompt shapes as a list of engine prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _without_special_tokens(prompt: PromptInput, tokenizer: Any) -> PromptInput:
    if not isinstance(prompt, str):
        return prompt  # token ids are taken as given
    try:
        check_text(prompt, "prompt")
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="prompt") from exc
    return {
        "prompt": prompt,
        "prompt_token_ids": tokenizer.encode(prompt, add_special_tokens=False),
    }


class CompletionServing(OpenAIServing[CompletionRequest, CompletionLogprobs]):
    """Prompts as given; a stream's chunks have the collected response's shape."""

    request_id_prefix = "cmpl"
    prompt_param = "prompt"
    response_cls = CompletionResponse
    chunk_cls = CompletionResponse

    def _prepare(self, body: CompletionRequest) -> tuple[list[PromptInput], SamplingParams]:
        check_cap(
            "max_tokens", body.max_tokens, self.config.effective_max_tokens_cap, "--max-tokens-cap"
        )
        check_cap("logprobs", body.logprobs, self.config.max_logprobs, "--max-logprobs")
        prompts = _prompts(body.prompt)
        if len(prompts) > self.config.max_prompts:
            raise OpenAIError(
                400,
                f"at most {self.config.max_prompts} prompts per request (this server's "
                f"--max-prompts), got {len(prompts)}",
                param="prompt",
            )
        if not body.add_special_tokens:
            tokenizer = self.engine.engine.tokenizer
            prompts = [_without_special_tokens(p, tokenizer) for p in prompts]
        guided = guided_decoding_for(body)
        params = build_sampling_params(body, self.config, body.max_tokens, body.logprobs, guided)
        return prompts, params

    def _logprobs(
        self, body: CompletionRequest, output: CompletionOutput, offset: int
    ) -> tuple[CompletionLogprobs | None, int]:
        if body.logprobs is None:
            return None, offset
        return completion_logprobs(output.token_ids, output.logprobs or [], offset)

    def _choice(
        self,
        body: CompletionRequest,
        index: int,
        output: CompletionOutput,
        logprobs: CompletionLogprobs | None,
    ) -> CompletionChoice:
        return CompletionChoice(
            index=index,
            text=output.text,
            logprobs=logprobs,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
        )
