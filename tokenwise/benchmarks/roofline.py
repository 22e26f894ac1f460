"""How much of the machine's matmul ceiling a benchmark run turned into useful work.

`request_flops` counts the matmul FLOPs an ideal engine needs for a request (no padding, no
recomputation, lm_head only where a token is sampled); `measure_matmul_flops` measures the
ceiling on this machine in the same process. Their ratio over a run's wall time is the
"roofline" fraction `benchmarks/compare_hf.py` reports. Decode on CPU is bound by memory
bandwidth rather than by matmul rate, so small batches sit far below 100% by nature; the
figure is for comparing engines on the same workload, not an absolute target.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenwise.benchmarks.common import BenchRequest


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer that decide its matmul work."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From an HF config object or its `config.json` dict."""

        def get(name: str, default: Any = None) -> Any:
            if isinstance(config, dict):
                return config.get(name, default)
            return getattr(config, name, default)

        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        return cls(
            hidden=hidden,
            layers=int(get("num_hidden_layers")),
            heads=heads,
            kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or hidden // heads),
            intermediate=int(get("intermediate_size")),
            vocab=int(get("vocab_size")),
        )

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's linears: q, k, v, o and the gated MLP (gate, up, down).
        Norms and biases are elementwise work and left out."""
        q_dim = self.heads * self.head_dim
        kv_dim = self.kv_heads * self.head_dim
        attn = self.hidden * (q_dim + 2 * kv_dim) + q_dim * self.hidden
        return attn + 3 * self.hidden * self.intermediate

    @property
    def body_params(self) -> int:
        """Non-embedding matmul parameters (all layers; without the embedding and lm_head)."""
        return self.layers * self.layer_matmul_params


def request_flops(shape: ModelShape, prompt_len: int, output_len: int) -> float:
    """The matmul FLOPs an ideal engine needs to serve one request (greedy, no recomputation).

    - The model runs on `prompt_len + output_len - 1` tokens (the last sampled token is never
      fed back): 2 x body_params FLOPs each (one multiply-add per weight).
    - The lm_head (hidden x vocab) is needed once per sampled token: `output_len` times. An
      engine that projects every prompt position to the vocabulary does extra, useless work.
    - Attention: the token at 1-based position t attends t keys; q.K^T and P.V cost
      2 x q_dim x t each, per layer: 4 x layers x q_dim x t, summed over t = 1..n (q_dim =
      heads x head_dim, which equals hidden for Llama but not for Qwen3).
    """
    if prompt_len < 1 or output_len < 1:
        raise ValueError("prompt_len and output_len must be at least 1")
    n = prompt_len + output_len - 1
    body = 2.0 * shape.body_params * n
    lm_head = 2.0 * shape.hidden * shape.vocab * output_len
    attention = 4.0 * shape.layers * shape.heads * shape.head_dim * (n * (n + 1) / 2)
    return body + lm_head + attention


def workload_flops(shape: ModelShape, requests: Iterable[BenchRequest]) -> float:
    return sum(request_flops(shape, r.prompt_len, r.output_len) for r in requests)


def measure_matmul_flops(
    size: int = 2048, repeats: int = 5, dtype: str = "bfloat16", budget_s: float = 2.0
) -> float:
    """FLOP/s of a square `size`^3 matmul in `dtype` on this machine (median of `repeats`,
    after one warm-up): the practical ceiling a linear layer can reach here.

    A CPU without native kernels for `dtype` (bf16 without AVX512_BF16 or AMX) runs a scalar
    fallback hundreds of times slower, where one 2048^3 product takes minutes; so a 256^3
    product is timed first and the size shrinks until one product fits in about
    `budget_s / (repeats + 1)` seconds."""
    import torch

    torch_dtype = getattr(torch, dtype)

    def timed(n: int, count: int) -> float:
        a = torch.randn(n, n).to(torch_dtype)
        b = torch.randn(n, n).to(torch_dtype)
        torch.mm(a, b)  # warm-up: first-call dispatch and page faults
        times = []
        for _ in range(count):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
        return 2.0 * n**3 / max(statistics.median(times), 1e-9)

    probe = timed(256, 1)
    per_product = budget_s / (repeats + 1)
    while size > 256 and 2.0 * size**3 / probe > per_product:
        size //= 2
    return timed(size, repeats)
