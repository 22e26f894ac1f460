"""instructor, in its TOOLS and JSON_SCHEMA modes, against `tokenwise serve`.

instructor turns a pydantic model into a forced tool call (TOOLS: `tools` + a named
`tool_choice`) or a `response_format` JSON schema (JSON_SCHEMA), then validates the reply into
the model. The built-in model writes no meaningful text, so the server's guided decoding is what
makes the reply valid: the test checks that instructor gets an instance with fields of the
declared types and bounds, and that the request really went through the mode's route (the raw
completion carries the tool call, or the JSON text, instructor validated).
"""

from __future__ import annotations

import json
from typing import Annotated

import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests._optional import require
from tests.clients._chat_server import SERVED_NAME
from tests.entrypoints._server import RemoteServer

instructor = require("instructor", "instructor (pip install instructor)")


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    tags: list[Annotated[str, Field(max_length=8)]] = Field(max_length=2)


MESSAGES = [{"role": "user", "content": "Extract: Ada, 36, mathematician."}]


def client(server: RemoteServer, mode) -> object:
    openai = OpenAI(base_url=server.url("/v1"), api_key="unused", timeout=120.0, max_retries=0)
    return instructor.from_openai(openai, mode=mode)


def check_person(person: object) -> None:
    assert isinstance(person, Person)
    assert isinstance(person.name, str) and len(person.name) <= 12
    assert isinstance(person.age, int) and 0 <= person.age <= 120
    assert isinstance(person.tags, list) and len(person.tags) <= 2
    assert all(isinstance(tag, str) and len(tag) <= 8 for tag in person.tags)


@pytest.mark.parametrize("seed", [0])
def test_tools_mode_extracts_through_a_forced_tool_call(server: RemoteServer, seed: int) -> None:
    person, completion = client(server, instructor.Mode.TOOLS).create_with_completion(
        model=SERVED_NAME,
        response_model=Person,
        messages=MESSAGES,
        max_tokens=160,
        temperature=1.0,
        seed=seed,
        max_retries=0,
    )
    check_person(person)
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.name == "Person"
    assert (
        Person.model_validate(json.loads(call.function.arguments)).model_dump()
        == person.model_dump()
    )
    assert completion.usage.completion_tokens > 0


@pytest.mark.parametrize("seed", [0])
def test_json_schema_mode_extracts_through_response_format(server: RemoteServer, seed: int) -> None:
    person, completion = client(server, instructor.Mode.JSON_SCHEMA).create_with_completion(
        model=SERVED_NAME,
        response_model=Person,
        messages=MESSAGES,
        max_tokens=160,
        temperature=1.0,
        seed=seed,
        max_retries=0,
    )
    check_person(person)
    message = completion.choices[0].message
    assert not message.tool_calls
    assert Person.model_validate_json(message.content).model_dump() == person.model_dump()
