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


# Planted in the server process and in its engine-core process, which multiprocessing's spawn
# starts by importing this module as `__mp_main__` (the step runs there); not in a test that
# merely imports a constant from here.
if __name__ in ("__main__", "__mp_main__"):
    LLMEngine.step = _slow_step  # type: ignore[method-assign]
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
