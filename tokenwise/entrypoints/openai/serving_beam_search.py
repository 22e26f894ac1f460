"""`use_beam_search: true` on `/v1/completions` (vLLM's extension): `n` is the beam width and
the `n` best beams of each prompt are its choices, best first (choice `i * n + j` is beam `j`
of prompt `i`, as with samples).

The search is `entrypoints/beam_search.py`'s, the one `LLM.beam_search` runs: each step submits
every live beam of every prompt as one-token requests with the top-K logprobs (and the
request's `priority`), through the same engine as every other request (so the waiting bound and
disconnects apply per step). The fields it reads: `n`, `max_tokens`, `ignore_eos`,
`temperature` (0 or unset), `length_penalty`, `early_stopping` (Hugging Face's: false, true or
"never"), `include_stop_str_in_output`. Streaming, `logprobs` and `echo` are refused with a 400
naming them; other sampling fields do not apply to a beam search and are not read.
"""

from __future__ import annotations

import itertools
import re
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response

from tokenwise.engine.prompts import resolve_eos_token_ids, validate_request
from tokenwise.entrypoints.beam_search import (
    BeamSearch,
    BeamSearchParams,
    run_beam_search_async,
    top_logprobs,
)
from tokenwise.entrypoints.openai.errors import OpenAIError, invalid_request
from tokenwise.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from tokenwise.entrypoints.openai.serving_common import json_response, unless_disconnected
from tokenwise.outputs import RequestOutput
from tokenwise.sampling.params import SamplingParams

if TYPE_CHECKING:
    from tokenwise.engine.prompts import PromptInput
    from tokenwise.entrypoints.openai.async_engine import AsyncEngine
    from tokenwise.lora.request import LoRARequest

# BeamSearchParams' field -> the request field it comes from.
_FIELDS = {"beam_width": "n", "max_tokens": "max_tokens"}
_LEADING_NAME = re.compile(r"^(\w+)[ =]")


def beam_search_params(body: CompletionRequest, max_tokens: int) -> BeamSearchParams:
    """The request's beam-search parameters, or a 400 naming the field that is wrong."""
    for name, unsupported in (
        ("stream", body.stream),
        ("logprobs", body.logprobs is not None),
        ("echo", body.echo),
    ):
        if unsupported:
            raise OpenAIError(400, f"{name} is not supported with use_beam_search", param=name)
    try:
        return BeamSearchParams(
            beam_width=body.n,
            max_tokens=max_tokens,
            ignore_eos=body.ignore_eos,
            temperature=0.0 if body.temperature is None else body.temperature,
            length_penalty=body.length_penalty,
            include_stop_str_in_output=body.include_stop_str_in_output,
            early_stopping=body.early_stopping,
        )
    except ValueError as exc:
        match = _LEADING_NAME.match(str(exc))
        name = match.group(1) if match else None
        raise OpenAIError(400, str(exc), param=_FIELDS.get(name or "", name)) from exc


async def create_beam_search(
    engine: AsyncEngine,
    served_model_name: str,
    body: CompletionRequest,
    raw: Request,
    request_id: str,
    prompts: list[PromptInput],
    params: SamplingParams,
    lora_request: LoRARequest | None,
) -> Response:
    """Run the searches of every prompt of the request to their end; one collected response."""
    assert params.max_tokens is not None
    beam = beam_search_params(body, params.max_tokens)
    model, tokenizer = engine.engine.model_config, engine.engine.tokenizer
    eos = resolve_eos_token_ids(model, tokenizer)
    searches = []
    for prompt in prompts:
        try:
            _, token_ids = validate_request(model, tokenizer, prompt, SamplingParams())
        except (ValueError, TypeError) as exc:
            raise invalid_request(exc, "prompt") from exc
        if len(token_ids) + beam.max_tokens > model.max_model_len:
            raise OpenAIError(
                400,
                f"max_tokens={beam.max_tokens} with a prompt of {len(token_ids)} tokens exceeds "
                f"max_model_len={model.max_model_len}",
                param="max_tokens",
            )
        searches.append(BeamSearch(token_ids, beam, eos))
    steps = itertools.count()

    async def step(beams: list[list[int]], k: int) -> list[dict[int, float]]:
        one_token = SamplingParams(temperature=0.0, max_tokens=1, logprobs=k, ignore_eos=True)
        inputs: list[PromptInput] = [{"prompt_token_ids": b} for b in beams]
        rid = f"{request_id}-beam{next(steps)}"
        stream = await engine.submit(rid, inputs, one_token, lora_request, body.priority)
        merged: dict[int, RequestOutput] = {}
        try:
            async for index, delta in stream:
                if delta.error is not None:
                    raise OpenAIError(500, f"beam search step failed: {delta.error}")
                if index in merged:
                    merged[index].merge(delta)
                else:
                    merged[index] = delta
        finally:
            stream.close()
        entries = [(merged[i].outputs[0].logprobs or [None])[0] for i in range(len(beams))]
        return [top_logprobs(entry, k) for entry in entries]

    async def search_all() -> bool:
        await run_beam_search_async(searches, step)
        return True

    if await unless_disconnected(raw, search_all()) is None:
        return Response(status_code=499)  # the client left: the step's requests were aborted
    decode = None if tokenizer is None else tokenizer.decode
    choices = []
    prompt_tokens = completion_tokens = 0
    for i, search in enumerate(searches):
        result = search.result(decode)
        prompt_tokens += search.num_prompt_tokens
        for j, seq in enumerate(result.sequences):
            completion_tokens += len(seq.output_token_ids)
            text = seq.text or ""
            index = i * body.n + j
            choices.append(
                CompletionChoice(index=index, text=text, finish_reason=seq.finish_reason)
            )
    return json_response(
        CompletionResponse(
            id=request_id,
            model=served_model_name,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            ),
        )
    )
