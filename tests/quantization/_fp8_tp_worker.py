"""Rank body for test_fp8_tp (its own module so `spawn` can import it by name).

Each rank joins a 2-rank gloo TP group, loads every case's FP8 checkpoint (CPU, fp32, fp8 bytes
kept) and reports the logits of one prompt and every FP8 layer's bytes and scales, or the error
loading raised.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch

from tests.quantization._tp_exact_worker import TP_SIZE, load, prompt_ids


def fp8_layers(model: Any) -> dict[str, Any]:
    """Each FP8 layer's (weight bytes, scale) per part, as numpy arrays."""
    out: dict[str, Any] = {}
    for name, module in model.named_modules():
        held = getattr(module, "quant_weight", None)
        if held is None or isinstance(held, torch.Tensor):
            continue
        parts = getattr(held, "parts", [held])
        out[name] = [
            (p.weight.view(torch.uint8).numpy().copy(), p.scale.numpy().copy()) for p in parts
        ]
    return out


def run_rank(rank: int, port: int, cases: dict[str, str], results: Any) -> None:
    from tokenwise.distributed.tp_state import destroy_tp_group, init_tp_group

    try:
        os.environ["TOKENWISE_CPU_FP8_WEIGHTS"] = "fp8"
        torch.set_num_threads(1)  # two ranks share the test machine's cores
        init_tp_group(TP_SIZE, rank, init_method=f"tcp://127.0.0.1:{port}")
        report: dict[str, Any] = {}
        for name, path in cases.items():
            try:
                model = load(path, TP_SIZE)
            except ValueError as e:
                report[name] = {"refused": str(e)}
                continue
            ids = prompt_ids()
            with torch.no_grad():
                logits = model.compute_logits(model(ids, torch.arange(ids.numel())))
            report[name] = {"logits": logits.numpy().copy(), "fp8": fp8_layers(model)}
        destroy_tp_group()
        results.put((rank, report))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))
