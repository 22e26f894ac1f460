"""Resident weight memory of a model loaded with `quantization="int8" | "int4"` against bf16.

    python benchmarks/quantized_memory.py [--shape qwen3-0.6b]

Builds the shape's model (`benchmarks/configs/<shape>`, its real vocabulary, random weights:
`load_format="dummy"`) three times, in bf16, int8 and int4, each in a fresh process, and prints
per run: the bytes of every tensor the model holds (parameters not on the meta device plus the
quantized tables, each counted once) and the process's resident set size after loading
(`/proc/self/status` VmRSS, which includes torch itself: the first row is the baseline), with
the ratio of weight bytes to bf16's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHILD = """
import json, sys, torch
from tokenwise.config import EngineConfig
from tokenwise.loader import load_model
from tokenwise.model_config import ModelConfig
config = ModelConfig.from_pretrained(sys.argv[1], dtype="bfloat16", load_format="dummy",
                                     quantization=None if sys.argv[2] == "none" else sys.argv[2])
model = load_model(EngineConfig(model=config))
held = {}
for module in model.modules():
    for name in ("quant_weight", "quant_table"):
        table = getattr(module, name, None)
        if table is not None and not isinstance(table, torch.Tensor):
            held[id(table)] = table.nbytes
dense = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
rss = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
print(json.dumps({"weights": dense + sum(held.values()), "rss": rss}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-0.6b")
    args = parser.parse_args()
    config = json.loads((REPO / "benchmarks" / "configs" / args.shape / "config.json").read_text())
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(config))
        results = {}
        for method in ("none", "int8", "int4"):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, model_dir, method],
                capture_output=True, text=True, check=True, timeout=1800,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )  # fmt: skip
            results[method] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["none"]["weights"]
    print(f"{args.shape} (vocab {config['vocab_size']}), random weights")
    print("| weights | weight bytes | of bf16 | process RSS after load |")
    print("|---|---|---|---|")
    for method, r in results.items():
        label = "bf16" if method == "none" else method
        print(
            f"| {label} | {r['weights'] / 2**20:.0f} MiB | {r['weights'] / base:.1%} | "
            f"{r['rss'] / 2**20:.0f} MiB |"
        )


if __name__ == "__main__":
    main()
