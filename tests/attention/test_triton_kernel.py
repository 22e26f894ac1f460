"""The Triton paged-decode kernel against the torch backend's decode, under Triton's interpreter.

Triton is installed with xgrammar (a tokenwise dependency) on Linux x86_64, so this runs in CI;
where Triton is missing the module is skipped, except under `CI=true`, where it fails
(`tests._optional.require`).

`TRITON_INTERPRET=1` makes `@triton.jit` kernels run in NumPy on CPU tensors, so the kernel's
indexing, masking and online softmax are checked here. On a GPU machine,
`TRITON_INTERPRET=0 python -m pytest tests/attention/test_triton_kernel.py` runs the same cases
through the compiled kernel on CUDA tensors (passed on an H100; its speed is in
`benchmarks/triton_decode_bench.py`).

Each backend fills its own cache through its own forward (a prefill), so the comparison holds
whatever layout each one picks; then one decode step per sequence is compared.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from tests._optional import require

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported
require("triton")

from tests.attention._metadata_oracle import ListMetadataBuilder  # noqa: E402
from tokenwise.attention.backends.torch_backend import (  # noqa: E402
    TorchAttentionBackend,
    TorchAttentionImpl,
    paged_decode_reference,
)
from tokenwise.attention.backends.triton_backend import (  # noqa: E402
    TritonAttentionBackend,
    TritonAttentionImpl,
)

CASES = [
    # heads, kv heads, head size, block size, sequence lengths, sliding window, dtype
    (8, 2, 16, 4, [1, 2, 5, 13, 30], None, torch.float32),
    (4, 4, 32, 16, [3, 16, 17, 40], None, torch.float32),
    (6, 2, 24, 8, [9, 33], 7, torch.float32),
    (16, 8, 64, 16, [70, 12, 1], None, torch.float16),
    (8, 1, 16, 4, [20, 7, 11], 5, torch.float32),
]


def _kernel_and_device():
    """Interpreted on CPU tensors, or compiled on a GPU when run with TRITON_INTERPRET=0."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        pytest.skip("no GPU: set TRITON_INTERPRET=1 to run the kernel on CPU tensors")
    return importlib.import_module("tokenwise.attention.backends.triton_paged_decode"), device


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head", "block", "lengths", "window", "dtype"), CASES
)
def test_kernel_matches_the_torch_backend_decode(
    heads: int,
    kv_heads: int,
    head: int,
    block: int,
    lengths: list[int],
    window: int | None,
    dtype: torch.dtype,
) -> None:
    _check(heads, kv_heads, head, block, lengths, window, dtype, sinks=None)


@pytest.mark.parametrize("case", [0, 2, 3])
def test_kernel_with_sinks_matches_the_torch_backend_decode(case: int) -> None:
    """gpt-oss's sinks (one logit per head in the softmax denominator): the Triton kernel,
    the torch backend's CPU decode (the C kernel) and the reference agree. Sinks around the
    scores' size, so they take a real share of each head's weight."""
    heads = CASES[case][0]
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(case)) * 2 + 1
    _check(*CASES[case], sinks=sinks)


def _check(
    heads: int,
    kv_heads: int,
    head: int,
    block: int,
    lengths: list[int],
    window: int | None,
    dtype: torch.dtype,
    sinks: torch.Tensor | None,
) -> None:
    kernel, device = _kernel_and_device()
    if sinks is not None:
        sinks = sinks.to(device, dtype)
    gen = torch.Generator().manual_seed(sum(lengths) + block)
    num_blocks = sum(-(-(n + 1) // block) for n in lengths) + 4
    tables, perm = [], torch.randperm(num_blocks, generator=gen).tolist()
    for n in lengths:
        nb = -(-(n + 1) // block)
        tables.append(perm[:nb])
        perm = perm[nb:]
    scale = head**-0.5
    seqs = [
        [
            torch.randn(n + 1, h * head, generator=gen).to(device, dtype)
            for h in (heads, kv_heads, kv_heads)
        ]
        for n in lengths
    ]
    outputs = {}
    for name, backend, impl_cls in (
        ("torch", TorchAttentionBackend, TorchAttentionImpl),
        ("triton", TritonAttentionBackend, TritonAttentionImpl),
    ):
        shape = backend.get_kv_cache_shape(num_blocks, block, kv_heads, head)
        cache = torch.randn(shape, generator=torch.Generator().manual_seed(9)) * 10
        cache = cache.to(device, dtype)
        impl = impl_cls(heads, head, scale, kv_heads, sliding_window=window)
        impl.sinks = sinks
        prefill = ListMetadataBuilder(block, window, device=device)
        for i, n in enumerate(lengths):
            prefill.add_sequence(i, 0, n, tables[i]) if n > 1 else None
        prompts = [i for i, n in enumerate(lengths) if n > 1]
        if prompts:
            md = prefill.build([lengths[i] for i in prompts], [lengths[i] for i in prompts])
            q, k, v = (torch.cat([seqs[i][j][: lengths[i]] for i in prompts]) for j in range(3))
            impl.forward(q, k, v, cache, md)
        decode = ListMetadataBuilder(block, window, device=device)
        for i, n in enumerate(lengths):
            ctx = n if n > 1 else 0
            decode.add_sequence(i, ctx, 1, tables[i])
        ctx_lens = [n if n > 1 else 0 for n in lengths]
        md = decode.build([c + 1 for c in ctx_lens], [1] * len(lengths))
        q, k, v = (
            torch.stack([s[j][c] for s, c in zip(seqs, ctx_lens, strict=True)]) for j in range(3)
        )
        if name == "torch":
            outputs[name] = impl.forward(q, k, v, cache, md).view(-1, heads, head)
            continue
        # The triton backend's own cache write, then the kernel on its cache.
        impl.forward(q, k, v, cache, md)
        first = None
        if window is not None and any(md.block_table_first_block):
            first = torch.tensor(md.block_table_first_block, dtype=torch.int32, device=device)
        args = (q.view(-1, heads, head), cache[0], cache[1], md.block_tables, md.seq_lens_tensor)
        outputs[name] = kernel.paged_decode(*args, scale, window, first, sinks=sinks)
        outputs["reference"] = paged_decode_reference(*args, scale, window, first, sinks=sinks)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(
        outputs["triton"].float(), outputs["torch"].float(), atol=tol, rtol=tol
    )
    torch.testing.assert_close(
        outputs["triton"].float(), outputs["reference"].float(), atol=tol, rtol=tol
    )
