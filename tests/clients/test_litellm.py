"""litellm's `hosted_vllm/` provider against `tokenwise serve`: a completion and a streamed one.

litellm routes `hosted_vllm/<model>` to an OpenAI-compatible server at `api_base`. The test
checks what it returns against what the server reports for the same greedy request through
the plain openai client: the same text, the same finish reason, the same usage counts.
"""

from __future__ import annotations

import os

import pytest
from openai import OpenAI

from tests._optional import require
from tests.clients._chat_server import SERVED_NAME
from tests.entrypoints._server import RemoteServer

# litellm fetches its model-price map from GitHub on import unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = require("litellm", "litellm (pip install litellm)")
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*ReadOnly:UserWarning"),
    pytest.mark.filterwarnings("ignore::pydantic.PydanticDeprecatedSince211"),
]

MESSAGES = [{"role": "user", "content": "def fibonacci(n):"}]
GREEDY = {"temperature": 0.0, "max_tokens": 12}


@pytest.fixture(scope="module")
def expected(server: RemoteServer):
    """The server's own answer to the greedy request, through the openai client."""
    openai = OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)
    reply = openai.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, **GREEDY)
    assert reply.choices[0].message.content
    return reply


def test_completion_matches_the_server(server: RemoteServer, expected) -> None:
    response = litellm.completion(
        model=f"hosted_vllm/{SERVED_NAME}",
        api_base=server.url("/v1"),
        messages=MESSAGES,
        num_retries=0,
        **GREEDY,
    )
    choice = response.choices[0]
    assert choice.message.content == expected.choices[0].message.content
    assert choice.finish_reason == expected.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == expected.usage.prompt_tokens
    assert response.usage.completion_tokens == expected.usage.completion_tokens == 12
    assert response.usage.total_tokens == expected.usage.total_tokens


def test_streamed_completion_matches_the_server(server: RemoteServer, expected) -> None:
    chunks = list(
        litellm.completion(
            model=f"hosted_vllm/{SERVED_NAME}",
            api_base=server.url("/v1"),
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            num_retries=0,
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.choices[0].message.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    # The stream's usage, and litellm's rebuilt response, carry the server's counts.
    usage = next(c.usage for c in reversed(chunks) if getattr(c, "usage", None))
    assert usage.prompt_tokens == expected.usage.prompt_tokens
    assert usage.completion_tokens == expected.usage.completion_tokens
    rebuilt = litellm.stream_chunk_builder(chunks, messages=MESSAGES)
    assert rebuilt.choices[0].message.content == text
    assert rebuilt.usage.completion_tokens == expected.usage.completion_tokens
    assert rebuilt.usage.prompt_tokens == expected.usage.prompt_tokens
