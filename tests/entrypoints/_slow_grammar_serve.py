"""`tokenwise serve` whose grammar compiles take 3 s: the compile timeout, made deterministic.

A real grammar's compile time depends on the machine (a regex that took seconds on a busy
2-core runner compiled within a millisecond on an idle one), so the timeout test plants the
delay instead: `python -m tests.entrypoints._slow_grammar_serve serve <args>`.
"""

from __future__ import annotations

import sys
import time

from tokenwise.entrypoints.cli import main
from tokenwise.sampling.guided.compiler import GrammarCompileCache

COMPILE_DELAY_S = 3.0

_compile = GrammarCompileCache._compile


def _slow_compile(self: GrammarCompileCache, spec: object) -> object:
    time.sleep(COMPILE_DELAY_S)
    return _compile(self, spec)  # type: ignore[arg-type]


# Planted in the server process and in its engine-core process, which multiprocessing's spawn
# starts by importing this module as `__mp_main__` (the step runs there); not in a test that
# merely imports a constant from here.
if __name__ in ("__main__", "__mp_main__"):
    GrammarCompileCache._compile = _slow_compile  # type: ignore[method-assign]
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
