"""The scheduler's waiting queue, one class per scheduling policy (vLLM's `scheduling_policy`).

- "fcfs" (`FCFSRequestQueue`): arrival order; a preempted request goes back to the head. When
  the KV pool runs short the most recently admitted running request is the one preempted, and
  a waiting request never displaces a running one.
- "priority" (`PriorityRequestQueue`): ordered by `(priority, arrival)`, lower values first
  (a request's `priority`, then its arrival time, then the order it was made in, so samples of
  one request keep their order). The preemption victim is the running request with the worst
  such key, and a waiting request displaces a running one whose `priority` is strictly worse
  (a tie never preempts, so two requests can never take turns preempting each other).

Both offer the same operations, named as in vLLM's request queues: `add_request`,
`prepend_request(s)` (a preempted or passed-over request going back), `peek_request`,
`pop_request`, `remove_requests`, iteration (in serving order), `len` and truth.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator

from tokenwise.config import SCHEDULING_POLICIES
from tokenwise.engine.request import Request


def _key(req: Request) -> tuple[int, float, int]:
    return (req.priority, req.arrival_time, req.seq)


class FCFSRequestQueue(deque):
    """Arrival order. A deque, so the queue's FCFS order is exactly the deque's."""

    policy = "fcfs"

    def add_request(self, req: Request) -> None:
        self.append(req)

    def prepend_request(self, req: Request) -> None:
        self.appendleft(req)

    def prepend_requests(self, reqs: list[Request]) -> None:
        """Put `reqs` back at the head, in their order."""
        self.extendleft(reversed(reqs))

    def peek_request(self) -> Request:
        return self[0]

    def pop_request(self) -> Request:
        return self.popleft()

    def remove_requests(self, reqs: Iterable[Request]) -> None:
        gone = {id(r) for r in reqs}
        kept = [r for r in self if id(r) not in gone]
        self.clear()
        self.extend(kept)

    @staticmethod
    def victim_index(running: list[Request]) -> int:
        """Which running request to preempt when the pool is short: the last admitted."""
        return len(running) - 1

    @staticmethod
    def displaces(waiting: Request, running: Request) -> bool:
        """Whether `waiting` may preempt `running` to be admitted: never, first come first served."""
        return False


class PriorityRequestQueue:
    """A heap on `(priority, arrival_time, seq)`: the most urgent request first."""

    policy = "priority"

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], Request]] = []

    def add_request(self, req: Request) -> None:
        heapq.heappush(self._heap, (_key(req), req))

    # A request going back keeps its key: its place is where its priority and arrival put it.
    prepend_request = add_request

    def prepend_requests(self, reqs: list[Request]) -> None:
        for req in reqs:
            self.add_request(req)

    def peek_request(self) -> Request:
        return self._heap[0][1]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove_requests(self, reqs: Iterable[Request]) -> None:
        gone = {id(r) for r in reqs}
        self._heap = [entry for entry in self._heap if id(entry[1]) not in gone]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (req for _, req in sorted(self._heap, key=lambda entry: entry[0]))

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    @staticmethod
    def victim_index(running: list[Request]) -> int:
        """The running request with the worst `(priority, arrival)`."""
        return max(range(len(running)), key=lambda i: _key(running[i]))

    @staticmethod
    def displaces(waiting: Request, running: Request) -> bool:
        return waiting.priority < running.priority


RequestQueue = FCFSRequestQueue | PriorityRequestQueue


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(
        f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}"
    )


def check_priority(priority: object, policy: str) -> int:
    """A request's `priority` as given, or a ValueError naming it: an integer, and non-zero
    only under the "priority" policy (as vLLM refuses it)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(
            f"priority={priority} needs scheduling_policy='priority' (this engine schedules "
            f"{policy!r}, where every request's priority is 0)"
        )
    return priority
