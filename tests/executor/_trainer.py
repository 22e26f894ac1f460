"""A stand-in trainer process: joins the engine's weight group as rank 0 and sends a checkpoint.

Run as `python -m tests.executor._trainer HOST PORT WORLD_SIZE CHECKPOINT_DIR`; exits 0 once
every tensor was sent.
"""

from __future__ import annotations

import glob
import os
import sys

from safetensors.torch import load_file

from tokenwise.distributed.weight_transfer import WeightSender  # torch only: a quick import


def main(host: str, port: str, world_size: str, checkpoint: str) -> None:
    tensors = {}
    for path in sorted(glob.glob(os.path.join(checkpoint, "*.safetensors"))):
        tensors.update(load_file(path))
    sender = WeightSender(host, int(port), int(world_size), timeout_s=60)
    sent = sender.send(tensors.items())
    print(f"sent {sent} tensors", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
