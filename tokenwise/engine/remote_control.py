"""A core process's `SleepControl` driven from the front end, over the control socket.

The server's front end (`EngineCoreClient`) refuses new requests itself while the core sleeps
or is paused: it mirrors the core's state (`ServingState`) from each call's answer, so the
check costs no round trip. Calls are answered between two of the core's steps.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

from tokenwise.engine import core_messages as msg
from tokenwise.engine.sleep_control import EngineAsleepError, ServingState, SleepControl

# The calls a front end may make on a core process's `SleepControl` (`ControlCall`).
CONTROL_METHODS = frozenset(
    {
        "sleep",
        "wake_up",
        "pause_generation",
        "resume_generation",
        "collective_rpc",
        "update_weights",
    }
)


def answer_control_call(control: SleepControl, call: msg.ControlCall) -> msg.ControlDone:
    """Run a front end's call in the core process; the answer carries the state afterwards."""
    result = None
    error = None
    try:
        if call.method not in CONTROL_METHODS:
            raise ValueError(f"unknown control call {call.method!r}")
        result = getattr(control, call.method)(*pickle.loads(call.payload))
    except Exception as exc:  # the front end raises it again, by its type's name
        error = f"{type(exc).__name__}: {exc}"
    return msg.ControlDone(error, pickle.dumps((result, control.state())))


class RemoteSleepControl(ServingState):
    """The front end's view of a core process's `SleepControl`: the same calls, sent over the
    control socket (`call(method, args) -> ControlDone`), and the state they leave mirrored
    here, so new requests are refused without a round trip."""

    def __init__(self, call: Callable[[str, tuple], msg.ControlDone]) -> None:
        super().__init__()
        self._call = call

    def _remote(self, method: str, *args: Any) -> Any:
        done = self._call(method, args)
        result, state = pickle.loads(done.payload)
        self._set_state(state)
        if done.error is not None:
            kind, _, text = done.error.partition(": ")
            error = _ERRORS.get(kind, RuntimeError)
            raise error(text if error is not RuntimeError else done.error)
        return result

    def sleep(self, level: int = 1) -> int:
        return self._remote("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._remote("wake_up", tags)

    def pause_generation(self) -> None:
        self._remote("pause_generation")

    def resume_generation(self) -> None:
        self._remote("resume_generation")

    def collective_rpc(self, *call: Any) -> list[Any]:
        """`SleepControl.collective_rpc(method, args, kwargs, timeout)` in the core."""
        return self._remote("collective_rpc", *call)

    def update_weights(self, method: str, args: tuple = ()) -> int:
        return self._remote("update_weights", method, args)


_ERRORS: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "EngineAsleepError": EngineAsleepError,
    "NotImplementedError": NotImplementedError,
}
