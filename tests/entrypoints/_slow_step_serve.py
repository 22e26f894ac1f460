"""`tokenwise serve` whose engine steps take at least 0.1 s: abort tests made deterministic.

Whether a disconnect aborts a request before it finishes must not depend on how fast the
machine generates (a tiny model on an idle machine finishes hundreds of tokens before a
client's timeout fires; on a loaded one it may not). With the delay planted in every engine
step, a request of N tokens takes at least N * STEP_DELAY_S, so a test can pick N far beyond
the time a disconnect takes to reach the engine:
`python -m tests.entrypoints._slow_step_serve serve <args>`.
"""

from __future__ import annotations

import sys
import time

from tokenwise.engine.llm_engine import LLMEngine
from tokenwise.entrypoints.cli import main

STEP_DELAY_S = 0.1

_step = LLMEngine.step


def _slow_step(self: LLMEngine) -> list:
    time.sleep(STEP_DELAY_S)
    return _step(self)


if __name__ == "__main__":
    LLMEngine.step = _slow_step  # type: ignore[method-assign]
    sys.exit(main(sys.argv[1:]))
