"""A streamed Messages reply as Anthropic's named server-sent events, from the chat reader's
deltas.

The chat endpoint's `ToolCallReader` already turns generated text into deltas of reasoning,
content and tool calls; this module only reshapes them into Anthropic's sequence:

    message_start                       (the message, empty, with its input token count)
    ping
    per content block, in order:
        content_block_start             (thinking, text or tool_use, empty)
        content_block_delta...          (thinking_delta, text_delta or input_json_delta)
        content_block_stop
    message_delta                       (stop_reason, stop_sequence, output token count)
    message_stop

A block is open until something of another kind arrives (or another call starts); a forced
call's arguments stream as `input_json_delta` pieces as they are generated, Hermes-format calls
arrive whole (one piece). An error after the 200 is an `error` event in Anthropic's shape, and
ends the stream.
"""

from __future__ import annotations

import json
from typing import Any

from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.protocol import DeltaMessage
from tokenwise.entrypoints.openai.protocol_anthropic import MessageResponse, new_tool_use_id


def event_line(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class MessageEvents:
    """Builds one message's events; `message` holds the id, model and input token count."""

    def __init__(self, message: MessageResponse) -> None:
        self.message = message
        self._index = -1  # the open block's index (-1: none opened yet)
        self._open: str | None = None  # its kind: "thinking", "text" or "tool_use"

    def start(self) -> list[str]:
        snapshot = self.message.model_dump(mode="json")
        return [
            event_line({"type": "message_start", "message": snapshot}),
            event_line({"type": "ping"}),
        ]

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [event_line({"type": "content_block_stop", "index": self._index})]

    def _begin(self, block: dict[str, Any]) -> list[str]:
        events = self._close()
        self._index += 1
        self._open = block["type"]
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        return events + [event_line(start)]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event_line({"type": "content_block_delta", "index": self._index, "delta": delta})

    def feed(self, delta: DeltaMessage) -> list[str]:
        """The events for one reader delta."""
        events: list[str] = []
        if delta.reasoning_content:
            if self._open != "thinking":
                events += self._begin({"type": "thinking", "thinking": "", "signature": ""})
            events.append(
                self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content})
            )
        if delta.content:
            if self._open != "text":
                events += self._begin({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls or []:
            if call.id is not None or self._open != "tool_use":
                block = {"type": "tool_use", "id": new_tool_use_id(), "name": call.function.name}
                events += self._begin({**block, "input": {}})
            if call.function.arguments:
                piece = {"type": "input_json_delta", "partial_json": call.function.arguments}
                events.append(self._delta(piece))
        return events

    def finish(
        self, stop_reason: str | None, stop_sequence: str | None, output_tokens: int
    ) -> list[str]:
        """Close the last block and end the message."""
        message_delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": output_tokens},
        }
        return self._close() + [event_line(message_delta), event_line({"type": "message_stop"})]

    def error(self, error: OpenAIError) -> list[str]:
        return [event_line(error.anthropic_body())]
