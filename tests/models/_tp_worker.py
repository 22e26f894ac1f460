"""Rank body for test_tensor_parallel_models (its own module so `spawn` can import it by name).

Each rank joins a 2-rank gloo TP group, builds every case's model with `load_model` (so the
layers read their rank at construction and the loader slices the checkpoint), runs one prompt
without a forward context and reports its logits and every parameter it holds, as numpy arrays
(plain pickles: no shared-memory tensors outliving the process).
"""

from __future__ import annotations

import traceback
from typing import Any

import torch

TP_SIZE = 2


def prompt_ids(vocab_size: int) -> torch.Tensor:
    """One prompt touching both ends of the vocabulary (so both ranks' embedding rows)."""
    ids = torch.randint(0, vocab_size, (14,), generator=torch.Generator().manual_seed(3))
    return torch.cat([torch.tensor([1, vocab_size - 1]), ids, torch.tensor([0, vocab_size // 2])])


def run_case(path: str) -> dict[str, Any]:
    from tokenwise.config import EngineConfig, ParallelConfig
    from tokenwise.loader import load_model
    from tokenwise.model_config import ModelConfig

    config = EngineConfig(
        model=ModelConfig.from_pretrained(path, dtype="float32"),
        parallel=ParallelConfig(tensor_parallel_size=TP_SIZE),
    )
    model = load_model(config)
    ids = prompt_ids(int(config.model.hf_config.vocab_size))
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(ids.numel())))
    attn = model.model.layers[0].self_attn.attn
    if hasattr(attn, "dims"):  # MLA: its heads, and the width of one cached latent row
        heads = (attn.dims.num_heads, attn.kv_cache_shape(1, 16)[-1])
    else:
        heads = (attn.num_heads, attn.num_kv_heads)
    return {
        "logits": logits.numpy().copy(),
        "params": {name: p.detach().numpy().copy() for name, p in model.named_parameters()},
        "attn_heads": heads,
    }


def run_rank(rank: int, port: int, cases: dict[str, str], results: Any) -> None:
    from tokenwise.distributed.tp_state import destroy_tp_group, init_tp_group

    try:
        torch.set_num_threads(1)  # two ranks share the test machine's cores
        init_tp_group(TP_SIZE, rank, init_method=f"tcp://127.0.0.1:{port}")
        report = {name: run_case(path) for name, path in cases.items()}
        destroy_tp_group()
        results.put((rank, report))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))
