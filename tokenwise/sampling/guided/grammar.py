"""A guided-decoding spec as an xgrammar `Grammar`: parsing, which is where bad input fails.

Parsing a schema, regex or EBNF into a grammar is cheap and needs no tokenizer, so it runs at
submission, in whichever process receives the request (the engine, or the data-parallel front
end before it picks a rank): an invalid spec is refused there with a `ValueError` naming the
field and xgrammar's complaint, and never reaches a step. Compiling the grammar against the
vocabulary (the expensive part) happens later, off the step's path (`compiler`).
"""

from __future__ import annotations

import json
import re

import xgrammar

from tokenwise.sampling.guided.params import GuidedDecodingParams

# xgrammar's C++ errors start with a timestamp, a source location and sometimes the failed
# check's expression; a client needs only the sentence after them.
_LOG_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false:\s*")
# JSON output is compact except for this many spaces or newlines in a row: unbounded
# whitespace lets a small model pad a value forever and run out of tokens mid-object.
MAX_JSON_WHITESPACE = 2


def clean_error(exc: BaseException) -> str:
    """xgrammar's message without its C++ log prefix, on one line."""
    text = str(exc).strip()
    text = _LOG_PREFIX.sub("", text)
    text = _CHECK_PREFIX.sub("", text)
    return " ".join(text.split())


def build_grammar(spec: GuidedDecodingParams) -> xgrammar.Grammar:
    """Parse `spec` into a grammar; `ValueError("guided_decoding.<kind>: ...")` if invalid."""
    kind = spec.kind
    try:
        compact = spec.disable_any_whitespace
        if kind == "json":
            return json_schema_grammar(json.dumps(spec.json), compact)
        if kind == "json_object":
            return json_schema_grammar('{"type": "object"}', compact)
        if kind == "regex":
            assert spec.regex is not None
            return xgrammar.Grammar.from_regex(spec.regex)
        if kind == "choice":
            assert spec.choice is not None
            return xgrammar.Grammar.from_ebnf(choice_ebnf(spec.choice))
        assert spec.grammar is not None
        return xgrammar.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        what = {"json": "invalid JSON schema", "json_object": "invalid JSON schema"}.get(
            kind, f"invalid {kind}"
        )
        raise ValueError(f"guided_decoding.{kind}: {what}: {clean_error(exc)}") from exc


def json_schema_grammar(schema: str, compact: bool = False) -> xgrammar.Grammar:
    """`compact` (vLLM's `disable_any_whitespace`): xgrammar's `any_whitespace=False`, a fixed
    layout (one space after each `:` and `,`, none elsewhere), so the model spends no token on
    whitespace of its own choosing."""
    if compact:
        return xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
    return xgrammar.Grammar.from_json_schema(
        schema, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE
    )


def choice_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b"`: JSON string escapes are also EBNF string escapes."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)
