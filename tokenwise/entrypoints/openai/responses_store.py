"""The responses kept for `previous_response_id` and `GET|DELETE /v1/responses/{id}`: the last
N, in memory.

OpenAI keeps stored responses for 30 days; a single-process server cannot promise that, so it
keeps a bounded number (`--responses-store-size`, 0: none) and forgets the least recently used
first, so memory stays bounded whatever clients do. A continuation reads its predecessor, which
makes it recent again: a conversation in use is not the one forgotten. Each entry holds the
conversation as chat messages (input and output, without instructions) so that a continuation
renders it without converting anything again, and the response object for retrieval.

The server answers requests on one event loop, so no lock is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.protocol_responses import ResponseObject


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    conversation: list[dict[str, Any]]  # chat messages: every turn's input and output


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> None:
        if self.capacity == 0:
            return
        self._entries[response.id] = StoredResponse(response, conversation)
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def previous(self, response_id: str) -> StoredResponse:
        """The response a request continues; OpenAI's 400 when it is unknown (never stored,
        stored with `store: false`, or forgotten)."""
        entry = self.get(response_id)
        if entry is None:
            raise OpenAIError(
                400,
                f"Previous response with id {response_id!r} not found (this server keeps the "
                f"last {self.capacity} stored responses, in memory)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return entry

    def retrieve(self, response_id: str) -> ResponseObject:
        """`GET /v1/responses/{id}`; a 404 when it is not kept."""
        entry = self.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    def delete(self, response_id: str) -> None:
        """`DELETE /v1/responses/{id}`: forget it (nothing continues it any more)."""
        if self._entries.pop(response_id, None) is None:
            raise _not_found(response_id)


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"Response with id {response_id!r} not found",
        param="response_id",
        code="response_not_found",
    )
