"""Rank body for test_tp_exact (its own module so `spawn` can import it by name).

Each rank joins a 2-rank gloo TP group, loads every case's quantized checkpoint with
`load_model` (CPU, fp32: its layers keep quantized weights), and reports the logits of one
prompt, greedy tokens after it, every quantized layer's weight as numpy arrays, and the
row-parallel layers' effective dense weights.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch

TP_SIZE = 2
GREEDY_STEPS = 6


def prompt_ids() -> torch.Tensor:
    return torch.randint(2, 300, (16,), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def logits_and_greedy(model: Any) -> tuple[torch.Tensor, list[int]]:
    """The prompt's logits, and greedy tokens after it (each step the whole sequence again, no
    cache: the layers' own products, nothing of the engine's)."""
    ids = prompt_ids()
    logits = model.compute_logits(model(ids, torch.arange(ids.numel())))
    tokens: list[int] = []
    seq = ids
    for _ in range(GREEDY_STEPS):
        step = model.compute_logits(model(seq, torch.arange(seq.numel())))
        tokens.append(int(step[-1].argmax()))
        seq = torch.cat([seq, torch.tensor(tokens[-1:])])
    return logits, tokens


def packed_layers(model: Any) -> dict[str, Any]:
    """Each quantized layer's weight: (qweight, scales, offsets, input_perm, bits, group)."""
    out: dict[str, Any] = {}
    for name, module in model.named_modules():
        held = getattr(module, "quant_weight", None) or getattr(module, "quant_table", None)
        if held is None or isinstance(held, torch.Tensor):
            continue
        parts = getattr(held, "parts", [held])
        out[name] = [
            tuple(
                None if t is None else t.numpy().copy()
                for t in (p.qweight, p.scales, p.offsets, p.input_perm)
            )
            + (p.bits, p.group_size)
            for p in parts
        ]
    return out


def row_parallel_dense(model: Any) -> dict[str, Any]:
    """Each quantized o_proj / down_proj's effective dense weight (dequantized, any input order
    undone): what act-order layers are checked by."""
    out: dict[str, Any] = {}
    for name, module in model.named_modules():
        held = getattr(module, "quant_weight", None)
        if name.endswith(("o_proj", "down_proj")) and hasattr(held, "dequantize"):
            out[name] = held.dequantize(torch.float32).numpy().copy()
    return out


def load(path: str, tp: int) -> Any:
    from tokenwise.config import EngineConfig, ParallelConfig
    from tokenwise.loader import load_model
    from tokenwise.model_config import ModelConfig

    model = ModelConfig.from_pretrained(path, dtype="float32", skip_tokenizer_init=True)
    return load_model(EngineConfig(model=model, parallel=ParallelConfig(tensor_parallel_size=tp)))


def run_rank(rank: int, port: int, cases: dict[str, str], results: Any) -> None:
    from tokenwise.distributed.tp_state import destroy_tp_group, init_tp_group

    try:
        torch.set_num_threads(1)  # two ranks share the test machine's cores
        init_tp_group(TP_SIZE, rank, init_method=f"tcp://127.0.0.1:{port}")
        report = {}
        for name, path in cases.items():
            model = load(path, TP_SIZE)
            logits, tokens = logits_and_greedy(model)
            report[name] = {
                "logits": logits.numpy().copy(),
                "tokens": tokens,
                "packed": packed_layers(model),
                "dense": row_parallel_dense(model),
            }
        destroy_tp_group()
        results.put((rank, report))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))
