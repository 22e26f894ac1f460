"""`POST /v1/completions`: text in, text out, for one prompt or a batch of prompts.

Every prompt of a batch becomes its own engine request (they share steps like any other
requests); choice `i * n + j` is sample `j` of prompt `i`, as in OpenAI's and vLLM's servers.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response

from tokenwise.entrypoints.openai.async_engine import AsyncEngine, RequestStream
from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.logprobs import completion_logprobs
from tokenwise.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from tokenwise.entrypoints.openai.server_config import ServerConfig
from tokenwise.entrypoints.openai.serving_common import (
    SSE_DONE,
    UsageCounter,
    build_sampling_params,
    check_cap,
    check_model,
    event_stream,
    merge_by_prompt,
    respond,
    sse,
    stream_error,
    submit,
)

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


class CompletionServing:
    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config

    async def create(self, body: CompletionRequest, raw: Request) -> Response:
        check_model(body.model, self.config)
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
        params = build_sampling_params(body, self.config, body.max_tokens, body.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await submit(self.engine, request_id, prompts, params, "prompt")
        if body.stream:
            return event_stream(self._stream(body, request_id, stream))
        return await respond(raw, stream, self._collect(body, request_id, stream))

    async def _collect(
        self, body: CompletionRequest, request_id: str, stream: RequestStream
    ) -> CompletionResponse:
        merged = await merge_by_prompt(stream)
        usage = UsageCounter()
        choices = []
        for index in sorted(merged):
            out = merged[index]
            for c in out.outputs:
                usage.add(index, len(out.prompt_token_ids), len(c.token_ids))
                logprobs = None
                if body.logprobs is not None:
                    logprobs, _ = completion_logprobs(c.token_ids, c.logprobs or [], 0)
                choices.append(
                    CompletionChoice(
                        index=index * body.n + c.index,
                        text=c.text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        return CompletionResponse(
            id=request_id,
            model=self.config.served_model_name,
            choices=choices,
            usage=usage.usage(),
        )

    async def _stream(
        self, body: CompletionRequest, request_id: str, stream: RequestStream
    ) -> AsyncIterator[str]:
        model = self.config.served_model_name
        usage = UsageCounter()
        offsets: dict[int, int] = {}  # choice -> text offset of its next token
        try:
            async for index, delta in stream:
                if delta.error is not None:
                    yield stream_error(OpenAIError(500, f"generation failed: {delta.error}"))
                    break
                for c in delta.outputs:
                    usage.add(index, len(delta.prompt_token_ids), len(c.token_ids))
                    choice = index * body.n + c.index
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs, offsets[choice] = completion_logprobs(
                            c.token_ids, c.logprobs or [], offsets.get(choice, 0)
                        )
                    if (
                        not c.text
                        and c.finish_reason is None
                        and not (logprobs is not None and c.token_ids)
                    ):
                        continue  # nothing to say yet (e.g. text waiting for more UTF-8 bytes)
                    chunk = CompletionResponse(
                        id=request_id,
                        model=model,
                        choices=[
                            CompletionChoice(
                                index=choice,
                                text=c.text,
                                logprobs=logprobs,
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                            )
                        ],
                    )
                    yield sse(chunk)
            else:
                if body.stream_options is not None and body.stream_options.include_usage:
                    yield sse(
                        CompletionResponse(
                            id=request_id, model=model, choices=[], usage=usage.usage()
                        )
                    )
        except Exception as exc:
            yield stream_error(exc)
        finally:
            stream.close()
        yield SSE_DONE
