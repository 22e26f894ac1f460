"""Messages -> the prompt the model runs: the tokenizer's chat template, then its tokens.

Chat completions and `/tokenize` with messages render through here, so `/tokenize` reports
exactly the tokens a chat completion would run.

The rendered text is tokenized without special tokens by default, because chat templates write
their own BOS; letting the tokenizer add another would give the model a doubled BOS it never
saw in training (`add_special_tokens: true` asks for it anyway). A tokenizer without a
template, a template that fails on the messages, or messages that are not valid Unicode (a lone
surrogate, which JSON can escape) are the client's problem to fix (400), not a server error.

`chat_template_kwargs` become variables of the template (Qwen3 reads `enable_thinking`), as in
vLLM. A key that would instead set a parameter of the template call itself (`tokenize`,
`add_generation_prompt`, ...) is refused: those have request fields of their own. The request's
`reasoning_effort` is one more variable (gpt-oss's template writes it into its system message).

Messages reach the template in the form Hugging Face templates expect, as vLLM passes them: an
assistant's tool-call `arguments` as a JSON object, not OpenAI's JSON text (gpt-oss's and
Llama 3's templates write them with `tojson`, which would quote the text again), and its
`reasoning_content` also as `thinking` (where gpt-oss's template reads the reasoning that led to
a call; only for a message without content, which that template refuses alongside it).
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import jinja2

from tokenwise.engine.prompts import check_text
from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.protocol import ChatTemplateFields

# Names the template call binds itself (besides apply_chat_template's own parameters).
_TEMPLATE_CALL_NAMES = frozenset({"messages", "conversation", "tools", "documents"})


def _reserved_names(tokenizer: Any) -> set[str]:
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    own = {p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD}
    return own | _TEMPLATE_CALL_NAMES


def template_kwargs(tokenizer: Any, body: ChatTemplateFields) -> dict[str, Any]:
    """The template call's keyword arguments besides the messages."""
    if body.continue_final_message and body.add_generation_prompt:
        raise OpenAIError(
            400,
            "continue_final_message continues the last message, which add_generation_prompt "
            "(true by default) would close: set add_generation_prompt to false",
            param="continue_final_message",
        )
    extra = dict(body.chat_template_kwargs or {})
    clashes = sorted(set(extra) & _reserved_names(tokenizer))
    if clashes:
        raise OpenAIError(
            400,
            f"chat_template_kwargs may not set {clashes}: these are not template variables "
            "(use the request's own fields)",
            param="chat_template_kwargs",
        )
    if body.tools:
        extra["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools]
    if body.reasoning_effort is not None:
        extra["reasoning_effort"] = body.reasoning_effort
    extra["add_generation_prompt"] = body.add_generation_prompt
    if body.continue_final_message:  # only then: older tokenizers lack the parameter
        extra["continue_final_message"] = True
    return extra


def _messages(body: ChatTemplateFields, image_token: str | None) -> list[dict[str, Any]]:
    """The messages as the template gets them. Without images a list content is its texts
    joined; with images either Hugging Face's multimodal form (`{"type": "image"}` parts,
    `image_token` None) or one string with `image_token` where each image was."""
    messages = []
    for m in body.messages:
        message = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            texts = [getattr(part, "text", None) for part in m.content]
            if not any(t is None for t in texts):
                message["content"] = "\n".join(t for t in texts if t is not None)
            elif image_token is None:
                message["content"] = [
                    {"type": "image"} if t is None else {"type": "text", "text": t} for t in texts
                ]
            else:
                message["content"] = "\n".join(image_token if t is None else t for t in texts)
        if message.get("role") == "assistant":
            _as_template_expects(message)
        messages.append(message)
    return messages


def _arguments_object(call: Any) -> Any:
    """A tool call (a copy) with its JSON-text arguments as an object; else as it was."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call  # not JSON: the template gets the text as it was sent
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _as_template_expects(message: dict[str, Any]) -> None:
    """An assistant message's tool-call arguments as objects, its reasoning as `thinking`."""
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        message["tool_calls"] = [_arguments_object(call) for call in calls]
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and "thinking" not in message and not message.get("content"):
        message["thinking"] = reasoning


def _apply(tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise OpenAIError(
            400, f"the chat template failed on these messages: {exc}", param="messages"
        ) from exc


def render_chat(
    tokenizer: Any, body: ChatTemplateFields, image_token: str | None = None, num_images: int = 0
) -> dict[str, Any]:
    """The engine prompt ({"prompt", "prompt_token_ids"}) for the request's messages.

    With `num_images` image parts, the template renders Hugging Face's multimodal message
    form when it knows it (LLaVA's templates write the placeholder for each image part); one
    that does not (it reads `content` as a string) gets the placeholder `image_token` written
    into the text where each image was, as vLLM does for such templates.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(
            400,
            "this model's tokenizer has no chat template; use /v1/completions instead",
            param="messages",
            code="no_chat_template",
        )
    kwargs = template_kwargs(tokenizer, body)
    if not num_images or image_token is None:
        text = _apply(tokenizer, _messages(body, None), kwargs)
    else:
        try:
            text = _apply(tokenizer, _messages(body, None), kwargs)
        except OpenAIError:  # a template that concatenates `content` as a string
            text = ""
        if text.count(image_token) != num_images:
            text = _apply(tokenizer, _messages(body, image_token), kwargs)
        if text.count(image_token) != num_images:
            raise OpenAIError(
                400,
                f"the chat template placed {text.count(image_token)} image placeholders "
                f"({image_token!r}) for {num_images} images",
                param="messages",
            )
    try:
        check_text(text, "messages")
    except ValueError as exc:  # else the tokenizer's TypeError would be a 500
        raise OpenAIError(400, str(exc), param="messages") from exc
    ids = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    return {"prompt": text, "prompt_token_ids": ids}
