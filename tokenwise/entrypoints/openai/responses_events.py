"""A streamed response as OpenAI's server-sent events, from the chat reader's deltas.

The chat endpoint's `ToolCallReader` already turns generated text into deltas of reasoning,
content and tool calls; this module only reshapes them. The published order, each event with
the next `sequence_number`:

    response.created, response.in_progress
    per output item, in order:
        response.output_item.added
        message:   response.content_part.added, response.output_text.delta...,
                   response.output_text.done, response.content_part.done
        reasoning: the same with reasoning_text
        call:      response.function_call_arguments.delta..., ...arguments.done
        response.output_item.done
    response.completed (response.incomplete when max_output_tokens ran out)

An item is open until something else arrives: reasoning until content or a call, a message
until a call, a forced call's arguments until the reply ends. Every event goes out with its SSE
`event:` line, as OpenAI sends them; there is no `[DONE]`.
"""

from __future__ import annotations

import json
from typing import Any

from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.protocol import DeltaMessage, DeltaToolCall
from tokenwise.entrypoints.openai.protocol_responses import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    ResponseObject,
)


def event_line(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class ResponseEvents:
    """Builds one response's events; `response` is completed in place as items close."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self._sequence = 0
        self._open: OutputItem | None = None
        self._text = ""  # the open message's or reasoning's text so far

    def _event(self, type_: str, **fields: Any) -> str:
        payload = {"type": type_, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event_line(payload)

    def _snapshot(self) -> dict[str, Any]:
        return self.response.model_dump(mode="json")

    def start(self) -> list[str]:
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    def feed(self, delta: DeltaMessage) -> list[str]:
        events: list[str] = []
        if delta.reasoning_content:
            events += self._text_delta(OutputReasoning, delta.reasoning_content)
        if delta.content:
            events += self._text_delta(OutputMessage, delta.content)
        for piece in delta.tool_calls or []:
            events += self._call_delta(piece)
        return events

    def finish(self, status: str) -> list[str]:
        """Close what is open and end the stream with the finished response (its `status`
        and `usage` already set by the caller); the item cut short by an incomplete reply is
        itself "incomplete"."""
        events = self._close("incomplete" if status == "incomplete" else "completed")
        name = "response.incomplete" if status == "incomplete" else "response.completed"
        return events + [self._event(name, response=self._snapshot())]

    def error(self, error: OpenAIError) -> list[str]:
        """OpenAI's error event, then `response.failed`, for a failure after the 200."""
        self.response.status = "failed"
        self.response.error = {"code": error.code or "server_error", "message": error.message}
        return [
            self._event("error", code=error.code, message=error.message, param=error.param),
            self._event("response.failed", response=self._snapshot()),
        ]

    # ---- items -------------------------------------------------------------------------------

    def _add(self, item: OutputItem) -> list[str]:
        events = self._close()
        index = len(self.response.output)
        self.response.output.append(item)
        self._open, self._text = item, ""
        item.status = "in_progress"
        events.append(
            self._event(
                "response.output_item.added",
                output_index=index,
                item=item.model_dump(mode="json"),
            )
        )
        return events

    def _ids(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open.id, "output_index": len(self.response.output) - 1}

    def _text_delta(self, kind: type[OutputMessage | OutputReasoning], text: str) -> list[str]:
        events: list[str] = []
        if not isinstance(self._open, kind):
            events += self._add(kind())
            events.append(
                self._event(
                    "response.content_part.added",
                    **self._ids(),
                    content_index=0,
                    part=self._part(""),
                )
            )
        self._text += text
        name = "output_text" if kind is OutputMessage else "reasoning_text"
        extra = {"logprobs": []} if kind is OutputMessage else {}
        events.append(
            self._event(
                f"response.{name}.delta", **self._ids(), content_index=0, delta=text, **extra
            )
        )
        return events

    def _part(self, text: str) -> dict[str, Any]:
        if isinstance(self._open, OutputMessage):
            return OutputText(text=text).model_dump(mode="json")
        return ReasoningText(text=text).model_dump(mode="json")

    def _call_delta(self, piece: DeltaToolCall) -> list[str]:
        events: list[str] = []
        if piece.id is not None:  # a new call: its id and name come with its first piece
            name = piece.function.name or ""
            events += self._add(OutputFunctionCall(call_id=piece.id, name=name, arguments=""))
        call = self._open
        assert isinstance(call, OutputFunctionCall)
        arguments = piece.function.arguments or ""
        if arguments:
            call.arguments += arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta", **self._ids(), delta=arguments
                )
            )
        return events

    def _close(self, status: str = "completed") -> list[str]:
        item = self._open
        if item is None:
            return []
        ids = self._ids()
        events: list[str] = []
        if isinstance(item, OutputFunctionCall):
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    **ids,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
        else:
            name = "output_text" if isinstance(item, OutputMessage) else "reasoning_text"
            extra = {"logprobs": []} if isinstance(item, OutputMessage) else {}
            events.append(
                self._event(
                    f"response.{name}.done", **ids, content_index=0, text=self._text, **extra
                )
            )
            part = self._part(self._text)
            events.append(
                self._event("response.content_part.done", **ids, content_index=0, part=part)
            )
            if isinstance(item, OutputMessage):
                item.content = [OutputText(text=self._text)]
            else:
                item.content = [ReasoningText(text=self._text)]
        item.status = status  # type: ignore[assignment]
        events.append(
            self._event(
                "response.output_item.done",
                output_index=ids["output_index"],
                item=item.model_dump(mode="json"),
            )
        )
        self._open = None
        return events
