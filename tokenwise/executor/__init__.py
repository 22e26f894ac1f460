"""Executor -> worker -> runner: who owns which part of running the model.

- An **executor** (`executor.py`) owns the workers of one engine: it starts them (in this
  process, or spawned processes joined over torch.distributed), runs the one start-up sequence,
  hands each step to the driver worker, calls a method on every worker (`collective_rpc`), and
  stops them all.
- A **worker** (`worker.py`) owns one rank: its device, its process-group membership and one
  model runner. The driver's worker runs the engine's steps; every other rank's worker serves
  the driver's messages (`worker_main.py` is those processes' entry point).
- The **runner** (`tokenwise/runner/`) runs one forward pass and samples.
"""
