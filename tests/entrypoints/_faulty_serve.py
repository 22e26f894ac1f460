"""`tokenwise serve` with a bug planted in the engine loop, outside the model call.

A model error fails only its step's requests; a bug anywhere else in the loop kills it. This
launcher lets a test see what a real server process does then: `python -m
tests.entrypoints._faulty_serve serve <args>`.
"""

from __future__ import annotations

import sys

from tokenwise.engine.output_processor import OutputProcessor
from tokenwise.entrypoints.cli import main

PLANTED = "planted bug in output processing"


def _broken_route_samples(*_: object) -> None:
    raise RuntimeError(PLANTED)


# Planted in the server process and in its engine-core process, which multiprocessing's spawn
# starts by importing this module as `__mp_main__` (the step runs there); not in a test that
# merely imports a constant from here.
if __name__ in ("__main__", "__mp_main__"):
    OutputProcessor.record_samples = _broken_route_samples  # what the engine loop calls
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
