"""The plan runner of `benchmarks/gpu_check.py`: parts in order, each bounded, none fatal.

Why a plan and not a script: a GPU is lent rarely and briefly (15 minutes of device time, start-
up included), so one run must turn every "unverified on GPU" into a figure. A part that fails
or hangs must cost only its own time bound, never the figures of the parts after it, and a run
that falls behind must still end before the lease does (the global deadline skips what is left).

Every figure is one JSON line on stdout (`{"part", "figure", "value", "unit", "ok", ...}`), so
a caller (or the lead reading a device log) parses them line by line; a part that raises prints
`{"part", "error"}`, a part that cannot run here prints `{"part", "skipped": true, "reason"}`.
Time bounds use SIGALRM in the main thread: the engine stays on the thread it expects, and the
alarm interrupts the part at its next Python bytecode (a CUDA call already running finishes).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass, field
from typing import Any, TextIO


class PartTimeout(Exception):
    """A part ran past its bound (or past the global deadline)."""


class Skip(Exception):
    """Raised by a part that cannot run here (one GPU where it needs two; not built yet)."""


@dataclass(frozen=True)
class Part:
    """One step of the plan: `run(ctx)` prints its figures through `ctx.figure`."""

    name: str
    seconds: float  # its time bound on a GPU; a dry run gets the same bound
    run: Callable[[Context], None]
    doc: str = ""


@dataclass
class Context:
    """What every part gets: where to run, how big, and where its figures go."""

    device: str
    dry_run: bool
    workdir: str
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    out: TextIO = sys.stdout
    part: str = ""
    lines: list[dict[str, Any]] = field(default_factory=list)

    def size(self, dry: Any, full: Any) -> Any:
        """`dry` in a dry run (tiny shapes, a few tokens), else `full`."""
        return dry if self.dry_run else full

    def emit(self, record: dict[str, Any]) -> None:
        self.lines.append(record)
        self.out.write(json.dumps(record, default=str) + "\n")
        self.out.flush()

    def figure(self, figure: str, value: Any, unit: str, ok: bool = True, **extra: Any) -> None:
        """One measured figure of the current part, with whatever explains it in `extra`."""
        self.emit(
            {"part": self.part, "figure": figure, "value": value, "unit": unit, "ok": bool(ok)}
            | extra
        )


@contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise PartTimeout(f"ran past its bound of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_plan(
    parts: list[Part],
    ctx: Context,
    deadline_s: float,
    cleanup: Callable[[], None] | None = None,
) -> bool:
    """Run `parts` in order under their bounds and `deadline_s` in all; True when every part
    that ran printed only ok figures (skips are not failures: they say why)."""
    start = time.monotonic()
    all_ok = True
    for part in parts:
        ctx.part = part.name
        left = deadline_s - (time.monotonic() - start)
        if left < 1:
            ctx.emit(
                {"part": part.name, "skipped": True,
                 "reason": f"global deadline of {deadline_s:.0f} s reached"}
            )  # fmt: skip
            continue
        first = len(ctx.lines)
        began = time.monotonic()
        try:
            # Libraries print progress: stdout stays JSON lines only, the rest goes to stderr.
            with _alarm(min(part.seconds, left)), redirect_stdout(sys.stderr):
                part.run(ctx)
        except Skip as why:
            ctx.emit({"part": part.name, "skipped": True, "reason": str(why)})
        except (Exception, PartTimeout) as exc:  # report and go on: the others still run
            ctx.emit({"part": part.name, "error": f"{type(exc).__name__}: {exc}"[:500]})
            all_ok = False
        else:
            figures = [r for r in ctx.lines[first:] if "figure" in r]
            if not figures:
                ctx.emit({"part": part.name, "error": "the part printed no figure"})
                all_ok = False
            all_ok = all_ok and all(r["ok"] for r in figures)
        finally:
            if cleanup is not None:
                cleanup()
        ctx.emit({"part": part.name, "figure": "seconds", "value": round(
            time.monotonic() - began, 2), "unit": "s", "ok": True})  # fmt: skip
    return all_ok
