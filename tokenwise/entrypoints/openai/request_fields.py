"""Which request fields the server reads, ignores or refuses, and what it does with unknown ones.

Real clients send more than a server implements: the openai SDK forwards whatever `extra_body`
holds, load generators add vLLM's extensions (guidellm's `continuous_usage_stats`), evaluation
harnesses send `echo`. A server that refuses every field it does not know breaks them all for
fields that change nothing, so, as vLLM does, request bodies take any field:

- unknown fields (at any depth: `stream_options.foo` too) are ignored and named in one warning
  line per request on the `tokenwise.server` logger; `--strict-request-fields` turns them back
  into 400s naming the field, for who wants typos caught;
- `IGNORED`: fields of OpenAI's or vLLM's API that the server does not implement and whose
  value cannot change the reply a client reads (metadata, a beam-search knob without beam
  search): accepted, and named in the same warning when not at their default;
- `REFUSED`: fields not implemented yet whose value would change the reply in a way a client
  relies on (chat's echo, beam search, a custom chat template, ...): any value other than a no-op
  is a 400 naming the field, rather than a reply that silently lacks what was asked for.

Fields the server does implement keep their strict types (`RequestModel`): a bad value there is
still a 400 naming it. Both lists name fields declared on the request models (`protocol`), so
their types are checked too, and `tests/entrypoints/test_request_fields.py` checks the lists
against the models.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from tokenwise.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger("tokenwise.server")


class RequestModel(BaseModel):
    """A request body (or a part of one): strict types (no "10" -> 10 or true -> 1), and any
    other field accepted for `accept_fields` to judge. Models that are not RequestModels (chat
    messages, whose extra keys the chat template reads) are never reported for their extras."""

    model_config = ConfigDict(strict=True, extra="allow")


IGNORED = (
    "metadata",
    "store",
    "service_tier",
    "length_penalty",
    "early_stopping",
    "request_id",
    "cache_salt",
    # The Responses API's (`protocol_responses`).
    "reasoning",
    "prompt_cache_key",
    "safety_identifier",
)


# `IGNORED` fields a request does use when another field is set: beam search's knobs.
USED_WITH = {"length_penalty": "use_beam_search", "early_stopping": "use_beam_search"}


def _is_default(name: str, value: Any, body: BaseModel) -> bool:
    return value == type(body).model_fields[name].default


# field -> (is this value a no-op?, what a no-op value is, for the message)
# (A request model's `implemented_fields` names those of these it implements: completions'
# echo. vLLM's chat `echo` is another feature, still refused.)
REFUSED: dict[str, tuple[Callable[[str, Any, BaseModel], bool], str | None]] = {
    "echo": (_is_default, None),
    "use_beam_search": (_is_default, None),
    "chat_template": (_is_default, None),
}


def unknown_fields(value: Any, path: str = "") -> list[str]:
    """Dotted paths of the fields no RequestModel inside `value` declares."""
    found: list[str] = []
    if isinstance(value, BaseModel):
        if isinstance(value, RequestModel):
            found += [f"{path}{key}" for key in value.model_extra or {}]
        for name in type(value).model_fields:
            found += unknown_fields(getattr(value, name), f"{path}{name}.")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found += unknown_fields(item, f"{path}{i}.")
    return found


def _noop_text(name: str, body: BaseModel, hint: str | None) -> str:
    if hint is not None:
        return hint
    default = type(body).model_fields[name].default
    return {None: "null", True: "true", False: "false"}.get(default, repr(default))


def refuse_unsupported(body: BaseModel) -> None:
    """A 400 for the first `REFUSED` field whose value is not a no-op."""
    declared = type(body).model_fields
    implemented = getattr(type(body), "implemented_fields", frozenset())
    for name, (is_noop, hint) in REFUSED.items():
        if name in declared and name in body.model_fields_set and name not in implemented:
            if not is_noop(name, getattr(body, name), body):
                raise OpenAIError(
                    400,
                    f"{name} is not supported yet by this server; leave it out or set it to "
                    f"{_noop_text(name, body, hint)}",
                    param=name,
                    code="unsupported_parameter",
                )


def ignored_fields(body: BaseModel) -> list[str]:
    """The `IGNORED` fields this request sets to something other than their default (less
    those its endpoint implements: the Responses API stores responses and echoes metadata)."""
    declared = type(body).model_fields
    implemented = getattr(type(body), "implemented_fields", frozenset())
    return [
        name
        for name in IGNORED
        if name in declared
        and name not in implemented
        and name in body.model_fields_set
        and not _is_default(name, getattr(body, name), body)
        and not (USED_WITH.get(name) in implemented and getattr(body, USED_WITH[name], False))
    ]


def accept_fields(body: BaseModel, strict: bool, request_id: str, route: str) -> None:
    """Refuse what must be refused (400), and log one warning naming what is ignored."""
    unknown = unknown_fields(body)
    if unknown and strict:
        first = unknown[0]
        raise OpenAIError(
            400,
            f"{first}: unknown field (this server runs with --strict-request-fields)",
            param=first.split(".")[0],
        )
    refuse_unsupported(body)
    ignored = ignored_fields(body)
    if unknown or ignored:
        parts = []
        if unknown:
            parts.append("unknown " + ", ".join(unknown))
        if ignored:
            parts.append("not implemented " + ", ".join(ignored))
        logger.warning(
            "request %s (%s) sets fields this server ignores: %s",
            request_id,
            route,
            "; ".join(parts),
        )
