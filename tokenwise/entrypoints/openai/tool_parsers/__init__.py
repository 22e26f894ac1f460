"""Tool-call parsers, one module per model family, chosen with `tokenwise serve
--tool-call-parser NAME` (vLLM's names). `tool_choice="auto"` lets the model write calls in
its own format; the parser reads them back out of the reply (`tool_calls`).
"""

from __future__ import annotations

from tokenwise.entrypoints.openai.tool_parsers.base import ToolParser
from tokenwise.entrypoints.openai.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from tokenwise.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from tokenwise.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from tokenwise.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from tokenwise.entrypoints.openai.tool_parsers.openai import OpenAIToolParser
from tokenwise.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from tokenwise.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (
        HermesToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        Qwen3CoderToolParser,
        DeepSeekV3ToolParser,
        PythonicToolParser,
        OpenAIToolParser,
    )
}
# Without --tool-call-parser, "auto" reads Hermes / Qwen blocks, as tokenwise always has.
DEFAULT_TOOL_PARSER = "hermes"


def check_tool_call_parser(name: str | None, enable_auto_tool_choice: bool = False) -> None:
    """A clear error for an unknown `--tool-call-parser` (listing the valid names), or for
    `--enable-auto-tool-choice` without one (as vLLM: auto tool choice needs a parser)."""
    if name is not None and name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}")
    if enable_auto_tool_choice and name is None:
        raise ValueError(
            f"--enable-auto-tool-choice needs --tool-call-parser (one of {sorted(TOOL_PARSERS)})"
        )


__all__ = ["DEFAULT_TOOL_PARSER", "TOOL_PARSERS", "ToolParser", "check_tool_call_parser"]
