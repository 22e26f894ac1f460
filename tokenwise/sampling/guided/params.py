"""What a request asks its output to conform to: vLLM's `GuidedDecodingParams`.

A plain dataclass of strings, lists and dicts on purpose: `SamplingParams` travel to
data-parallel ranks by pickle, and a compiled grammar (a C++ object bound to one tokenizer)
must not. Each process that samples compiles the spec for itself (see `compiler`).

Only the shape of the spec is checked here (exactly one kind, the right Python types, a JSON
schema that is JSON); whether a schema, regex or grammar is *valid* is xgrammar's call, made
when the engine accepts the request (`grammar.build_grammar`), so every entry point reports it
the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The kinds, in the order their field names are reported.
GUIDED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class GuidedDecodingParams:
    """Exactly one of the fields: the output must match it.

    - ``json``: a JSON schema (a dict, or its JSON text); the output is one JSON value of it.
    - ``regex``: the whole output matches this regular expression.
    - ``choice``: the output is one of these strings, exactly.
    - ``grammar``: an EBNF grammar (GBNF dialect) whose ``root`` rule the output matches.
    - ``json_object``: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).

    ``disable_any_whitespace`` (vLLM's option, for ``json`` and ``json_object``): the JSON's
    layout is fixed (`{"a": 1, "b": 2}`: one space after each `:` and `,`, none elsewhere).
    By default a little free whitespace is allowed, which a small model can spend most of a
    short reply's tokens on.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in GUIDED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "guided_decoding must set exactly one of json, regex, choice, grammar or "
                f"json_object, got {given or 'none'}"
            )
        if self.json is not None:
            self.json = _schema_dict(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"guided_decoding.{name} must be a non-empty str, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(
                    f"guided_decoding.choice must be a non-empty list of str, got {self.choice!r}"
                )
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(
                    "guided_decoding.choice must contain only non-empty strings, "
                    f"got {self.choice!r}"
                )
            self.choice = list(self.choice)
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                "guided_decoding.disable_any_whitespace must be a bool, "
                f"got {self.disable_any_whitespace!r}"
            )
        if self.json_object not in (None, True):
            raise ValueError(f"guided_decoding.json_object must be True, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """Which field is set: one of `GUIDED_KINDS`."""
        return next(k for k in GUIDED_KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple[str, str]:
        """A hashable, canonical form: equal specs compile once (a schema's key order and
        spacing do not matter)."""
        kind = self.kind + (":compact" if self.disable_any_whitespace else "")
        if self.json is not None:
            return kind, json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        if self.choice is not None:
            return kind, json.dumps(self.choice)
        if self.json_object:
            return kind, ""
        return kind, getattr(self, self.kind)


def _schema_dict(schema: Any) -> dict[str, Any]:
    """The schema as a dict: JSON text is parsed here so a typo fails at submission."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"guided_decoding.json is not valid JSON: {exc}") from exc
    if schema is True:  # the schema that accepts everything
        schema = {}
    if not isinstance(schema, dict):
        raise ValueError(
            f"guided_decoding.json must be a JSON schema object, got {type(schema).__name__}"
        )
    return schema
