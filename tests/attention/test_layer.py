"""The `Attention` layer and its custom op `tokenwise::unified_attention` (forward-context.md §5).

References are dense float64 attention with explicit masks, built from the test's own K/V.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.attention._metadata_oracle import ListMetadataBuilder
from tokenwise.attention.backends.torch_backend import TorchAttentionBackend
from tokenwise.attention.layer import Attention
from tokenwise.attention.metadata import AttentionMetadata
from tokenwise.config import EngineConfig
from tokenwise.forward_context import is_forward_context_available, set_forward_context

H, KVH, D, B = 8, 2, 16, 4
SCALE = D**-0.5
NUM_BLOCKS = 16
TOL = {"atol": 1e-5, "rtol": 1e-5}


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, window: int | None = None
) -> torch.Tensor:
    """q: [q_len, H, D] at positions ctx..; k, v: [ctx + q_len, KVH, D]. Returns [q_len, H*D]."""
    n = k.shape[0]
    kk = k.double().repeat_interleave(H // KVH, dim=1)
    vv = v.double().repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * SCALE
    q_pos = torch.arange(ctx, n)[:, None]
    k_pos = torch.arange(n)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    out = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vv)
    return out.reshape(q.shape[0], H * D)


def qkv(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.randn(n, H, D, generator=gen),
        torch.randn(n, KVH, D, generator=gen),
        torch.randn(n, KVH, D, generator=gen),
    )


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def new_cache(gen: torch.Generator) -> torch.Tensor:
    shape = TorchAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, B, KVH, D)
    return torch.randn(shape, generator=gen) * 10


def metadata(items: list[tuple[int, int, int, list[int]]]) -> AttentionMetadata:
    """items: (seq_id, context_len, query_len, block_table), prefills first."""
    b = ListMetadataBuilder(B)
    for seq_id, ctx, ql, table in items:
        b.add_sequence(seq_id, ctx, ql, table)
    return b.build([c + q for _, c, q, _ in items], [q for _, _, q, _ in items])


@pytest.fixture(autouse=True)
def _no_context_leaks() -> None:
    assert not is_forward_context_available()


def test_registers_under_its_prefix() -> None:
    config = EngineConfig()
    a = Attention(H, D, SCALE, KVH, prefix="model.layers.0.self_attn.attn", config=config)
    b = Attention(H, D, SCALE, KVH, prefix="model.layers.1.self_attn.attn", config=config)
    registry = config.compilation.static_forward_context
    assert registry["model.layers.0.self_attn.attn"] is a
    assert registry["model.layers.1.self_attn.attn"] is b
    assert a.layer_name == "model.layers.0.self_attn.attn"
    with pytest.raises(ValueError, match="duplicate"):
        Attention(H, D, SCALE, KVH, prefix="model.layers.0.self_attn.attn", config=config)
    assert registry["model.layers.0.self_attn.attn"] is a  # the original is kept
    with pytest.raises(ValueError, match="needs its full module path as prefix"):
        Attention(H, D, SCALE, KVH, prefix="", config=config)
    # Another engine's config is a separate namespace.
    other = EngineConfig()
    Attention(H, D, SCALE, KVH, prefix="model.layers.0.self_attn.attn", config=other)
    assert registry["model.layers.0.self_attn.attn"] is a


def test_constructor_validation() -> None:
    with pytest.raises(
        ValueError, match=r"num_heads \(8\) must be a multiple of num_kv_heads \(3\)"
    ):
        Attention(8, D, SCALE, 3)
    layer = Attention(4, D, SCALE)  # kv heads default to heads (MHA)
    assert layer.num_kv_heads == 4


@pytest.mark.parametrize("window", [None, 3])
def test_outside_a_context_is_causal_attention_on_one_sequence(window: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    layer = Attention(H, D, SCALE, KVH, sliding_window=window)
    q, k, v = qkv(7, gen)
    out = layer(flat(q), flat(k), flat(v))
    assert out.shape == (7, H * D)
    torch.testing.assert_close(out.double(), reference(q, k, v, 0, window), atol=1e-5, rtol=1e-5)


def test_forward_in_context_uses_bound_cache() -> None:
    """Two steps through the layer: a prompt, then a chunk + a decode reading cached K/V."""
    gen = torch.Generator().manual_seed(1)
    config = EngineConfig()
    name = "model.layers.0.self_attn.attn"
    layer = Attention(H, D, SCALE, KVH, prefix=name, config=config)
    cache = new_cache(gen)
    layer.kv_cache = [cache]
    qa, ka, va = qkv(10, gen)
    qb, kb, vb = qkv(6, gen)
    ta, tb = [9, 2, 14], [5, 11]

    def step(md: AttentionMetadata, a: slice, b: slice) -> torch.Tensor:
        with set_forward_context(md, config):
            return layer(
                flat(torch.cat([qa[a], qb[b]])),
                flat(torch.cat([ka[a], kb[b]])),
                flat(torch.cat([va[a], vb[b]])),
            ).double()

    out = step(metadata([(0, 0, 6, ta), (1, 0, 5, tb)]), slice(0, 6), slice(0, 5))
    torch.testing.assert_close(out[:6], reference(qa[:6], ka[:6], va[:6], 0), **TOL)
    torch.testing.assert_close(out[6:], reference(qb[:5], kb[:5], vb[:5], 0), **TOL)
    # The bound cache received the K/V: position 5 of seq 0 is block ta[1], offset 1.
    assert torch.equal(cache[0, ta[1], 1], ka[5]) and torch.equal(cache[1, tb[1], 0], vb[4])

    # Chunk of seq 0 (context 6) and a decode of seq 1 (context 5) read the cached K/V.
    out = step(metadata([(0, 6, 4, ta), (1, 5, 1, tb)]), slice(6, 10), slice(5, 6))
    torch.testing.assert_close(out[:4], reference(qa[6:], ka, va, 6), **TOL)
    torch.testing.assert_close(out[4:], reference(qb[5:], kb, vb, 5), **TOL)


def test_virtual_engine_selects_the_cache() -> None:
    gen = torch.Generator().manual_seed(2)
    config = EngineConfig()
    layer = Attention(H, D, SCALE, KVH, prefix="attn", config=config)
    caches = [new_cache(gen), new_cache(gen)]
    before0 = caches[0].clone()
    layer.kv_cache = caches
    q, k, v = qkv(3, gen)
    with set_forward_context(metadata([(0, 0, 3, [4])]), config, virtual_engine=1):
        out = layer(flat(q), flat(k), flat(v))
    torch.testing.assert_close(out.double(), reference(q, k, v, 0), atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[0], before0)
    assert torch.equal(caches[1][0, 4, :3], k)


def test_per_layer_metadata_dict() -> None:
    """Two layers, two caches, two metadata objects with different block tables: each layer
    must read its own (a swap would gather the wrong blocks and fail the comparison)."""
    gen = torch.Generator().manual_seed(3)
    config = EngineConfig()
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    layers = [Attention(H, D, SCALE, KVH, prefix=n, config=config) for n in names]
    for layer in layers:
        layer.kv_cache = [new_cache(gen)]
    tables = [[3, 8, 1], [12, 0, 6]]
    data = [qkv(9, gen) for _ in layers]

    prompt = {n: metadata([(0, 0, 8, t)]) for n, t in zip(names, tables, strict=True)}
    decode = {n: metadata([(0, 8, 1, t)]) for n, t in zip(names, tables, strict=True)}
    for md, lo, hi in [(prompt, 0, 8), (decode, 8, 9)]:
        with set_forward_context(md, config):
            outs = [
                layer(flat(q[lo:hi]), flat(k[lo:hi]), flat(v[lo:hi]))
                for layer, (q, k, v) in zip(layers, data, strict=True)
            ]
        for out, (q, k, v) in zip(outs, data, strict=True):
            ref = reference(q[lo:hi], k[:hi], v[:hi], lo)
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # Each cache holds its own layer's keys at its own table's slots (position 8: block 1).
    for layer, (_, k, _), table in zip(layers, data, tables, strict=True):
        assert torch.equal(layer.kv_cache[0][0, table[2], 0], k[8])


def test_fake_implementation_shape_and_dtype() -> None:
    with FakeTensorMode():
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.empty(5, H * D, dtype=dtype)
            kv = torch.empty(5, KVH * D, dtype=dtype)
            out = torch.ops.tokenwise.unified_attention(q, kv, kv, "no.such.layer")
            assert out.shape == (5, H * D) and out.dtype == dtype


def _recording_backend(graphs: list[torch.fx.GraphModule]):  # noqa: ANN202
    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # noqa: ANN202
        graphs.append(gm)
        return gm.forward

    return backend


def _op_nodes(graphs: list[torch.fx.GraphModule]) -> list[torch.fx.Node]:
    ops = (torch.ops.tokenwise.unified_attention, torch.ops.tokenwise.unified_attention.default)
    return [n for g in graphs for n in g.graph.nodes if n.op == "call_function" and n.target in ops]


def test_op_compiles_as_one_opaque_node() -> None:
    """fullgraph=True fails on any graph break; the op shows up as a single node that is not
    traced into, and its body still runs (reading the forward context) at call time."""
    gen = torch.Generator().manual_seed(4)
    config = EngineConfig()
    layer = Attention(H, D, SCALE, KVH, prefix="attn", config=config)
    layer.kv_cache = [new_cache(gen)]
    q, k, v = qkv(6, gen)

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.tokenwise.unified_attention(q * 1.0, k, v, "attn") + 0.0

    graphs: list[torch.fx.GraphModule] = []
    compiled = torch.compile(f, backend=_recording_backend(graphs), fullgraph=True)
    with set_forward_context(metadata([(0, 0, 6, [7, 2])]), config):
        out = compiled(flat(q), flat(k), flat(v))
    assert len(graphs) == 1 and len(_op_nodes(graphs)) == 1
    torch.testing.assert_close(out.double(), reference(q, k, v, 0), atol=1e-5, rtol=1e-5)


def test_layer_forward_compiles_without_graph_break() -> None:
    gen = torch.Generator().manual_seed(6)
    config = EngineConfig()
    layer = Attention(H, D, SCALE, KVH, prefix="attn", config=config)
    layer.kv_cache = [new_cache(gen)]
    q, k, v = qkv(4, gen)
    graphs: list[torch.fx.GraphModule] = []
    compiled = torch.compile(layer, backend=_recording_backend(graphs), fullgraph=True)
    with set_forward_context(metadata([(0, 0, 4, [5])]), config):
        out = compiled(flat(q), flat(k), flat(v))
    assert len(_op_nodes(graphs)) == 1
    torch.testing.assert_close(out.double(), reference(q, k, v, 0), atol=1e-5, rtol=1e-5)


def test_opcheck() -> None:
    gen = torch.Generator().manual_seed(5)
    config = EngineConfig()
    layer = Attention(H, D, SCALE, KVH, prefix="attn", config=config)
    layer.kv_cache = [new_cache(gen)]
    q, k, v = qkv(5, gen)
    with set_forward_context(metadata([(0, 0, 5, [3, 9])]), config):
        torch.library.opcheck(
            torch.ops.tokenwise.unified_attention.default,
            (flat(q), flat(k), flat(v), "attn"),
            test_utils=("test_schema", "test_faketensor"),
        )
