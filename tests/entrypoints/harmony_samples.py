"""gpt-oss replies in the harmony format, written by hand, with what the parsers must read out of
them; and a tokenizer that speaks harmony (the tiny BPE plus harmony's special tokens and a
small harmony chat template of our own), for the parser and server tests.

Each reply is the model's text after the prompt's closing `<|start|>assistant`, decoded with
special tokens kept and its stop token (`<|return|>`, `<|call|>`) hidden, as the engine gives it.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from typing import Any

from tests.tiny_checkpoints import tiny_tokenizer

HARMONY_TOKENS = [
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
]

ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"

# Reasoning, then the answer.
ANSWER = f"{ANALYSIS}The user greets me. Reply briefly.<|end|>{FINAL}Hello! How can I help?"
# Reasoning, then a call: the recipient after the channel, the content type constrained.
CALL = (
    f"{ANALYSIS}Need the weather: call get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "days": 3}'
)

# (reply, reasoning, content, calls as (name, arguments text)) for reasoning parser
# `openai_gptoss` and tool-call parser `openai` together.
SAMPLES: list[tuple[str, str | None, str | None, list[tuple[str, str]]]] = [
    (ANSWER, "The user greets me. Reply briefly.", "Hello! How can I help?", []),
    (
        CALL,
        "Need the weather: call get_weather.",
        None,
        [("get_weather", '{"city": "Paris", "days": 3}')],
    ),
    # The recipient in the header before the channel (as the chat template renders calls), a
    # bare content type, the stop tokens kept (include_stop_str_in_output).
    (
        "<|start|>assistant to=functions.convert<|channel|>commentary json<|message|>"
        '{"amount": 5}<|call|>',
        None,
        None,
        [("convert", '{"amount": 5}')],
    ),
    # A preamble on the commentary channel, then a call without arguments.
    (
        f"{ANALYSIS}Plan.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking now."
        "<|end|><|start|>assistant<|channel|>commentary to=functions.ping<|message|><|call|>",
        "Plan.",
        "Checking now.",
        [("ping", "{}")],
    ),
    # Several analysis messages join with a newline; the final one ends with <|return|>.
    (
        f"{ANALYSIS}First.<|end|><|start|>assistant<|channel|>analysis<|message|>Second.<|end|>"
        f"{FINAL}Done.<|return|>",
        "First.\nSecond.",
        "Done.",
        [],
    ),
    # A new message begun without <|end|>: the next one still starts there.
    (f"{ANALYSIS}think{FINAL}answer", "think", "answer", []),
    # A built-in tool this server does not run: content, as written.
    (
        f"{ANALYSIS}Search.<|end|><|start|>assistant<|channel|>analysis to=browser.search"
        '<|message|>{"query": "x"}<|call|>',
        "Search.",
        '<|start|>assistant<|channel|>analysis to=browser.search<|message|>{"query": "x"}<|call|>',
        [],
    ),
    # Text with no harmony at all: content.
    ("Just text, a < b and <|odd|>.", None, "Just text, a < b and <|odd|>.", []),
    # Cut off (max_tokens): inside the reasoning; inside the final answer; inside a header.
    (f"{ANALYSIS}Still thinking <b", "Still thinking <b", None, []),
    (f"{ANALYSIS}ok<|end|>{FINAL}Partial ans", "ok", "Partial ans", []),
    (f"{ANALYSIS}ok<|end|><|start|>assistant<|channel|>comm", "ok", None, []),
    ("", None, None, []),
]

HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n"
    "{%- for t in tools %}\ntype {{ t.function.name }} = (_: {{ t.function.parameters | tojson }})"
    " => any;{% endfor %}\n} // namespace functions<|end|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>"
    "{%- endif %}{%- set call = m.tool_calls[0].function %}"
    "<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>"
    "{{ call.arguments | tojson }}<|call|>"
    "{%- elif m.role == 'assistant' %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' %}"
    "<|start|>functions.tool to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@lru_cache(maxsize=1)
def harmony_tokenizer() -> Any:
    """The tiny BPE with harmony's special tokens (each one token, kept whole) and template."""
    tok = copy.deepcopy(tiny_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tok.chat_template = HARMONY_TEMPLATE
    return tok
