"""Request and response bodies of `/tokenize` and `/detokenize` (vLLM's), as pydantic models.

Apart from `protocol.py` because they are no OpenAI endpoint and return no completion
envelope: `serving_tokenization` is their reader. A chat `/tokenize` takes the same template
fields as a chat completion (`ChatTemplateFields`), so the prompt it counts is the one a chat
completion would run.
"""

from __future__ import annotations

from pydantic import BaseModel

from tokenwise.entrypoints.openai.protocol import ChatTemplateFields
from tokenwise.entrypoints.openai.request_fields import RequestModel


class TokenizeCompletionRequest(RequestModel):
    """`POST /tokenize` with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields):
    """`POST /tokenize` with messages: the prompt a chat completion would run."""

    model: str | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
