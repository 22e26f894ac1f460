"""`POST /v1/completions`: text in, text out, for one prompt or a batch of prompts.

Every prompt of a batch becomes its own engine request (they share steps like any other
requests); choice `i * n + j` is sample `j` of prompt `i`, as in OpenAI's and vLLM's servers.
Text prompts are tokenized by the engine client, with the tokenizer's special tokens (BOS);
`add_special_tokens: false` tokenizes them here without, for prompts that carry their own.

`echo` puts the prompt before each choice's text (the prompt's text, or its tokens' text when
token ids came in), and with `logprobs` the prompt tokens' logprobs before the generated
ones': the first token's are null, the others come from the engine's `prompt_logprobs`
(top-`logprobs`, unless the request sets `prompt_logprobs` itself). With `max_tokens: 0` the
engine generates one token that is not returned (as vLLM does), so the choice is the prompt
alone and counts no completion tokens: lm-evaluation-harness's loglikelihood requests. A
stream sends the prompt in each choice's first chunk.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tokenwise.engine.prompts import check_text
from tokenwise.entrypoints.openai.access_log import set_request_id
from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.fim import fim_prompt
from tokenwise.entrypoints.openai.logprobs import completion_logprobs, prompt_logprobs_field
from tokenwise.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from tokenwise.entrypoints.openai.request_fields import accept_fields
from tokenwise.entrypoints.openai.serving_beam_search import create_beam_search
from tokenwise.entrypoints.openai.serving_common import (
    OpenAIServing,
    build_sampling_params,
    check_cap,
)
from tokenwise.entrypoints.openai.structured_outputs import guided_decoding_for
from tokenwise.outputs import CompletionOutput, RequestOutput
from tokenwise.sampling.params import SamplingParams

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import Response

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


def _echo_only(body: CompletionRequest) -> bool:
    """`echo` with `max_tokens: 0`: the prompt (and its logprobs) without a completion."""
    return body.echo and body.max_tokens == 0


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
    """Prompts as given; a stream's chunks have the collected response's shape; beam search
    with `use_beam_search` (`serving_beam_search`)."""

    request_id_prefix = "cmpl"
    prompt_param = "prompt"
    response_cls = CompletionResponse
    chunk_cls = CompletionResponse

    async def create(self, body: CompletionRequest, raw: Request) -> Response:
        """As every endpoint, unless `use_beam_search` (`serving_beam_search`)."""
        if not body.use_beam_search:
            return await super().create(body, raw)
        request_id = set_request_id(raw, self.request_id_prefix)
        accept_fields(body, self.config.strict_request_fields, request_id, raw.url.path)
        lora_request = self.models.resolve(body.model)
        prompts, params = self._prepare(body)
        return await create_beam_search(
            self.engine,
            self.config.served_model_name,
            body,
            raw,
            request_id,
            prompts,
            params,
            lora_request,
        )

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
        tokenizer = self.engine.engine.tokenizer
        if body.suffix:  # fill-in-the-middle: each prompt is the code before the gap
            prompts = [
                fim_prompt(tokenizer, p, body.suffix, body.add_special_tokens) for p in prompts
            ]
        elif not body.add_special_tokens:
            prompts = [_without_special_tokens(p, tokenizer) for p in prompts]
        guided = guided_decoding_for(body)
        # Echo scores the prompt for its logprobs; max_tokens 0 (lm-eval's loglikelihood may
        # send it) generates one token that is not returned, as in vLLM.
        prompt_logprobs = body.prompt_logprobs
        if body.echo and prompt_logprobs is None:
            prompt_logprobs = body.logprobs
        max_tokens = 1 if _echo_only(body) else body.max_tokens
        params = build_sampling_params(
            body, self.config, max_tokens, body.logprobs, guided, prompt_logprobs
        )
        return prompts, params

    def _present(
        self, body: CompletionRequest, out: RequestOutput, output: CompletionOutput, first: bool
    ) -> tuple[CompletionOutput, int]:
        """With echo, the prompt (text, tokens and their logprobs) before the choice's first
        piece; with echo and max_tokens 0, the prompt alone."""
        if not body.echo:
            return output, len(output.token_ids)
        keep = not _echo_only(body)
        text = output.text if keep else ""
        token_ids = list(output.token_ids) if keep else []
        logprobs = list(output.logprobs or []) if keep else []
        if first:
            prompt_ids = list(out.prompt_token_ids)
            prompt = out.prompt
            if prompt is None:  # token ids came in: their text is what the model read
                prompt = self.engine.engine.tokenizer.decode(prompt_ids)
            text = prompt + text
            token_ids = prompt_ids + token_ids
            scored = out.prompt_logprobs or [None] * len(prompt_ids)
            logprobs = list(scored) + logprobs
        shown = replace(output, text=text, token_ids=token_ids, logprobs=logprobs)
        return shown, len(token_ids) - (len(out.prompt_token_ids) if first else 0)

    def _extras(
        self, body: CompletionRequest, merged: dict[int, RequestOutput], choices: list
    ) -> dict[str, Any]:
        # vLLM's `prompt_logprobs` sit on each choice of completions.
        if body.prompt_logprobs is not None:
            for choice in choices:
                scored = merged[choice.index // body.n].prompt_logprobs
                choice.prompt_logprobs = prompt_logprobs_field(scored)
        return {}

    def _logprobs(
        self, body: CompletionRequest, output: CompletionOutput, offset: int
    ) -> tuple[CompletionLogprobs | None, int]:
        if body.logprobs is None:
            return None, offset
        tokenizer = self.engine.engine.tokenizer
        decode = None if tokenizer is None else (lambda t: tokenizer.decode([t]))
        return completion_logprobs(output.token_ids, output.logprobs or [], offset, decode)

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
