"""Hand-written replies in each model family's tool-call format, with what a parser must read
out of them: shared by the parser tests and the server tests (which plant these exact texts).

Each sample: (parser, reply, expected content, expected calls as (name, arguments value)).
"""

from __future__ import annotations

from typing import Any

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                    "ratio": {"type": ["number", "null"]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert",
            "parameters": {"type": "object", "properties": {"amount": {"type": "integer"}}},
        },
    },
]

WEATHER = ("get_weather", {"city": "Paris", "days": 3})
CONVERT = ("convert", {"amount": 5})

DS_CALLS, DS_CALL, DS_SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
DS_CALL_END, DS_CALLS_END = "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"

# One sample per family that the server tests plant: content before the calls, two calls.
PLANTED: dict[str, tuple[str, str | None, list[tuple[str, Any]]]] = {
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 3}}\n</tool_call>\n<tool_call>{"name": "convert", "arguments": {"amount": 5}}'
        "</tool_call>",
        "Let me check.",
        [WEATHER, CONVERT],
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
        '{"name": "convert", "parameters": {"amount": 5}}',
        None,
        [WEATHER, CONVERT],
    ),
    "mistral": (
        'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
        '[TOOL_CALLS]convert[ARGS]{"amount": 5}',
        "Let me check.",
        [WEATHER, CONVERT],
    ),
    "qwen3_coder": (
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=convert>\n<parameter=amount>\n5\n</parameter>\n</function>\n"
        "</tool_call>",
        "Let me check.",
        [WEATHER, CONVERT],
    ),
    "deepseek_v3": (
        f"Let me check.{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n"
        '{"city": "Paris", "days": 3}\n```'
        f"{DS_CALL_END}\n{DS_CALL}function{DS_SEP}convert\n```json\n"
        '{"amount": 5}\n```'
        f"{DS_CALL_END}{DS_CALLS_END}",
        "Let me check.",
        [WEATHER, CONVERT],
    ),
    "pythonic": (
        '[get_weather(city="Paris", days=3), convert(amount=5)]',
        None,
        [WEATHER, CONVERT],
    ),
}

# More replies per family: edge cases of each format.
SAMPLES: list[tuple[str, str, str | None, list[tuple[str, Any]]]] = [
    *((name, *sample) for name, sample in PLANTED.items()),
    # hermes: "parameters" and string arguments; malformed blocks stay content as written.
    (
        "hermes",
        '<tool_call>{"name": "a", "parameters": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>',
        None,
        [("a", {"x": 1}), ("b", {"y": 2})],
    ),
    (
        "hermes",
        "no calls, just <b>markup</b> and a < sign",
        "no calls, just <b>markup</b> and a < sign",
        [],
    ),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    # A call cut off inside its arguments keeps what was written; another key order is read
    # when the block closes.
    ("hermes", '<tool_call>{"name": "f", "arguments": {}', None, [("f", {})]),
    (
        "hermes",
        '<tool_call>{"arguments": {"x": 1}, "name": "a"}</tool_call>',
        None,
        [("a", {"x": 1})],
    ),
    (
        "hermes",
        '<tool_call>{"name": "a", "arguments": {"x": "}"}} </tool_call>',
        None,
        [("a", {"x": "}"})],
    ),
    # llama3_json: without the tag; a reply that is not JSON is content; text after calls.
    ("llama3_json", '  {"name": "convert", "arguments": {"amount": 5}}', None, [CONVERT]),
    ("llama3_json", "It is sunny in {city}.", "It is sunny in {city}.", []),
    (
        "llama3_json",
        '{"name": "convert", "parameters": {"amount": 5}} and then {"x": 1}',
        'and then {"x": 1}',
        [CONVERT],
    ),
    # Another key order is read whole: cut off, it is content as written.
    (
        "llama3_json",
        '{"parameters": {"amount": 5}, "name": "conv',
        '{"parameters": {"amount": 5}, "name": "conv',
        [],
    ),
    ("llama3_json", '{"parameters": {"amount": 5}, "name": "convert"}', None, [CONVERT]),
    (
        "llama3_json",
        '{"name": "a", "parameters": {"x": "}{", "y": {"z": []}} };',
        None,
        [("a", {"x": "}{", "y": {"z": []}})],
    ),
    # mistral: the older JSON-array form, and a name written straight before its object.
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
        '{"name": "convert", "arguments": {"amount": 5}}]',
        None,
        [WEATHER, CONVERT],
    ),
    ("mistral", '[TOOL_CALLS]convert{"amount": 5}', None, [CONVERT]),
    ("mistral", "[TOOL_CALLS] [not json]", "[TOOL_CALLS] [not json]", []),
    ("mistral", "a [TOOL] b [ARGS]", "a [TOOL] b [ARGS]", []),
    # qwen3_coder: values by schema type; untyped and unconvertible values stay strings.
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n"
        "<parameter=metric>\nTrue\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n"
        "<parameter=ratio>\nnull\n</parameter>\n<parameter=days>\nthree\n</parameter>\n"
        "<parameter=note>\n42\n</parameter>\n</function>\n</tool_call>",
        None,
        [
            (
                "get_weather",
                {
                    "city": "New\nYork",
                    "metric": True,
                    "hours": [1, 2],
                    "ratio": None,
                    "days": "three",
                    "note": "42",
                },
            )
        ],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=convert>\n</function>\n</tool_call>",
        None,
        [("convert", {})],
    ),
    ("qwen3_coder", "<tool_call>plain</tool_call>", "<tool_call>plain</tool_call>", []),
    # deepseek_v3: content after the section.
    (
        "deepseek_v3",
        f'{DS_CALLS}{DS_CALL}function{DS_SEP}convert\n```json\n{{"amount": 5}}\n```{DS_CALL_END}'
        f"{DS_CALLS_END}Done.",
        "Done.",
        [CONVERT],
    ),
    # pythonic: literals converted; anything but literals (a call inside) is not a call.
    (
        "pythonic",
        "[get_weather(city='Paris', hours=(1, 2), metric=False, ratio=None)]",
        None,
        [("get_weather", {"city": "Paris", "hours": [1, 2], "metric": False, "ratio": None})],
    ),
    (
        "pythonic",
        "[convert(amount=__import__('os').getpid())]",
        "[convert(amount=__import__('os').getpid())]",
        [],
    ),
    ("pythonic", "[1, 2] are numbers", "[1, 2] are numbers", []),
    ("pythonic", "<|python_start|>[convert(amount=5)]<|python_end|>", None, [CONVERT]),
]
