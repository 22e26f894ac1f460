"""The engine's side of sleep mode, paused generation and weight updates.

The workers do the work (`executor/worker.py`: `sleep`, `wake_up`, `reload_weights`,
`receive_weights`, reached through `collective_rpc`, so every tensor-parallel rank takes part);
the engine keeps what a request must be refused for, and what weights changing means for it:

- asleep (any tag still asleep), weights discarded by a level-2 sleep and not yet reloaded, or
  generation paused: a new request fails with `EngineAsleepError` (the server answers 503
  with its message);
- the KV cache's contents are gone after a sleep, and stale after new weights: the prefix
  cache is reset, so no request reuses blocks computed by other weights;
- each weight update counts one `weight_version`, which every output then reports.

Sleeping and updating weights need an idle engine (no unfinished request): a sleep under a
running request would pull the weights from under it, and the prefix cache cannot be reset
while requests hold blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenwise.executor.sleep_mode import SLEEP_LEVELS, WAKE_TAGS

# collective_rpc methods that write new values into the weights.
WEIGHT_UPDATE_METHODS = frozenset({"reload_weights", "receive_weights"})


class EngineAsleepError(RuntimeError):
    """The engine cannot take requests now (asleep, weights discarded, or paused)."""


class ServingState:
    """What decides whether a request is served: sleep level and tags, discarded weights,
    pause, and the weights' version. `SleepControl` owns it; `RemoteSleepControl` mirrors a
    core process's copy."""

    def __init__(self) -> None:
        self.level = 0
        self.asleep: set[str] = set()
        self.weights_discarded = False
        self.paused = False
        self.weight_version = 0

    def state(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "asleep": sorted(self.asleep),
            "weights_discarded": self.weights_discarded,
            "paused": self.paused,
            "weight_version": self.weight_version,
        }

    def _set_state(self, state: dict[str, Any]) -> None:
        self.level = state["level"]
        self.asleep = set(state["asleep"])
        self.weights_discarded = state["weights_discarded"]
        self.paused = state["paused"]
        self.weight_version = state["weight_version"]

    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def check_serving(self) -> None:
        """Raise `EngineAsleepError`, saying why, unless a request can be served now."""
        if self.asleep:
            raise EngineAsleepError(
                f"the engine is asleep (sleep level {self.level}, still asleep: "
                f"{', '.join(sorted(self.asleep))}); call wake_up first"
            )
        if self.weights_discarded:
            raise EngineAsleepError(
                "the weights were discarded by sleep(level=2): load new ones "
                "(reload_weights or a trainer's transfer) before serving"
            )
        if self.paused:
            raise EngineAsleepError("generation is paused; resume it first")


class SleepControl(ServingState):
    """Sleep state, pause state and weight version of one engine, and the calls that change
    them (in the engine's process: `LLM`, or a core process answering `ControlCall`s)."""

    def __init__(
        self,
        enabled: bool,
        rpc: Callable[..., list[Any]],
        is_idle: Callable[[], bool],
        reset_prefix_cache: Callable[[], bool],
    ) -> None:
        super().__init__()
        self.enabled = enabled
        self._rpc = rpc
        self._is_idle = is_idle
        self._reset_prefix_cache = reset_prefix_cache

    def _require_idle(self, what: str) -> None:
        if not self._is_idle():
            raise RuntimeError(
                f"{what} needs an idle engine: finish or abort the running requests first "
                "(the server's /pause does)"
            )

    def sleep(self, level: int = 1) -> int:
        """Put every worker to sleep; returns the bytes they handed back (all ranks)."""
        if not self.enabled:
            raise ValueError("sleep needs an engine started with enable_sleep_mode=True")
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.asleep:
            raise RuntimeError(f"the engine is already asleep (level {self.level})")
        self._require_idle("sleep")
        self._reset_prefix_cache()  # the blocks' contents are about to go
        released = sum(self._rpc("sleep", (level,)))
        self.level = level
        self.asleep = set(WAKE_TAGS)
        return released

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake what `tags` names ("weights", "kv_cache"; None: both)."""
        wanted = set(WAKE_TAGS if tags is None else tags)
        unknown = wanted - set(WAKE_TAGS)
        if unknown:
            raise ValueError(f"wake_up tags must be among {list(WAKE_TAGS)}, got {sorted(unknown)}")
        self._rpc("wake_up", (None if tags is None else list(tags),))
        if "weights" in wanted & self.asleep and self.level == 2:
            self.weights_discarded = True
        self.asleep -= wanted
        if not self.asleep:
            self.level = 0

    def collective_rpc(
        self,
        method: Any,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """`Executor.collective_rpc`; a weight update (`WEIGHT_UPDATE_METHODS`) needs an idle
        engine, and afterwards no cached prefix of the old weights is reused (even when it
        failed half-way); one that went through counts a new version."""
        updates = isinstance(method, str) and method in WEIGHT_UPDATE_METHODS
        if updates:
            self._require_idle(method)
        try:
            results = self._rpc(method, args, kwargs, timeout)
        finally:
            if updates:
                self._reset_prefix_cache()
        if updates:
            self.weights_discarded = False
            self.weight_version += 1
        return results

    def update_weights(self, method: str, args: tuple = ()) -> int:
        """Run a weight update on every worker; returns the driver's result (what it loaded)."""
        if method not in WEIGHT_UPDATE_METHODS:
            raise ValueError(f"{method!r} is not a weight update ({sorted(WEIGHT_UPDATE_METHODS)})")
        return self.collective_rpc(method, args)[0]

    def pause_generation(self) -> None:
        """Refuse new requests until `resume_generation` (running ones are the caller's)."""
        self.paused = True

    def resume_generation(self) -> None:
        self.paused = False
