"""Piecewise compilation: cut the model's graph at every attention call, compile the rest.

Dynamo traces the whole model into one FX graph in which each `tokenwise::unified_attention`
call is a single opaque node (the op reads batch state from the forward context, which nothing
compiled may do). This backend cuts that graph at those nodes with `torch.fx.passes.split_module`,
so a model of L layers becomes 2L + 1 pieces: L attention pieces that run eagerly (they look up
metadata and the KV cache every step) and L + 1 pieces in between (norms, projections, rotary,
MLP, residual adds) that Inductor compiles. Why cut at all, when the fullgraph path already
treats attention as opaque: each compiled piece is free of batch-dependent host logic, so on a
GPU it can be captured as a CUDA graph per padded token count and replayed, while attention,
whose kernels and metadata change with the batch layout, stays outside the graphs.

Every piece is compiled once for a symbolic token count (the outer trace is dynamic in it), and
wrapped by a `wrap_piece` hook: on CUDA that is the graph capture/replay wrapper of
`tokenwise.compilation.cuda_graph`, on CPU the compiled piece is called as it is.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

logger = logging.getLogger(__name__)

# Newer torch can make every piece return a tuple; older releases (the GPU image has 2.11)
# return a lone output bare, which the split graph and Inductor handle just as well.
_SPLIT_KWARGS = (
    {"tuple_return": True} if "tuple_return" in inspect.signature(split_module).parameters else {}
)

# (piece index, compiled callable, which args are static) -> the callable the graph calls.
PieceWrapper = Callable[[int, Callable[..., Any], list[bool]], Callable[..., Any]]


@dataclass
class PieceInfo:
    """One piece of the split graph: its submodule name and whether it is a splitting op."""

    name: str
    is_splitting_op: bool
    graph: fx.GraphModule


def _is_splitting_node(node: fx.Node, splitting_ops: Sequence[str]) -> bool:
    """Whether `node` calls one of `splitting_ops` ("namespace::name", any overload)."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        name = target.overloadpacket._qualified_op_name
    elif isinstance(target, torch._ops.OpOverloadPacket):
        name = target._qualified_op_name
    else:
        return False
    return name in splitting_ops


def split_graph(
    gm: fx.GraphModule, splitting_ops: Sequence[str]
) -> tuple[fx.GraphModule, list[PieceInfo]]:
    """Cut `gm` before and after every splitting-op call; each such call gets its own piece."""
    partition_of: dict[fx.Node, int] = {}
    current = 0
    splitting: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if _is_splitting_node(node, splitting_ops):
            current += 1
            partition_of[node] = current
            splitting.add(current)
            current += 1
        else:
            partition_of[node] = current
    split_gm = split_module(
        gm, None, lambda node: partition_of[node], keep_original_order=True, **_SPLIT_KWARGS
    )
    pieces: list[PieceInfo] = []
    for node in split_gm.graph.nodes:
        if node.op != "call_module":
            continue
        index = int(str(node.target).rsplit("_", 1)[1])
        pieces.append(
            PieceInfo(str(node.target), index in splitting, getattr(split_gm, str(node.target)))
        )
    return split_gm, pieces


def _no_wrap(index: int, compiled: Callable[..., Any], static: list[bool]) -> Callable[..., Any]:
    return compiled


def _is_static_arg(arg: Any) -> bool:
    """Weights and buffers have fixed shapes; activations carry the symbolic token count."""
    if not isinstance(arg, torch.Tensor):
        return True
    return not any(isinstance(s, torch.SymInt) for s in arg.shape)


class _PieceCompiler(torch.fx.Interpreter):
    """Runs the split graph on fake inputs; compiles each non-splitting piece on the way.

    Running on the fake tensors Dynamo traced with gives every piece example inputs with the
    same symbolic sizes, so each piece compiles once for any token count.
    """

    def __init__(
        self,
        split_gm: fx.GraphModule,
        to_compile: set[str],
        compile_piece: Callable[[fx.GraphModule, list[Any]], Callable[..., Any]],
        wrap_piece: PieceWrapper,
        fake_mode: Any,
    ) -> None:
        super().__init__(split_gm)
        self.to_compile = to_compile
        self.compile_piece = compile_piece
        self.wrap_piece = wrap_piece
        self.fake_mode = fake_mode
        self.compiled: dict[str, Callable[..., Any]] = {}

    def run(self, *args: Any) -> Any:  # type: ignore[override]
        fake_args = [
            self.fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args
        ]
        with self.fake_mode:
            return super().run(*fake_args)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        output = super().call_module(target, args, kwargs)
        if target in self.to_compile:
            submod = self.fetch_attr(target)
            static = [_is_static_arg(a) for a in args]
            compiled = self.compile_piece(submod, list(args))
            index = len(self.compiled)
            self.compiled[target] = self.wrap_piece(index, compiled, static)
        return output


def inductor_compile_piece(submod: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """Compile one piece with Inductor for the (symbolic) shapes of its example inputs."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(submod, example_inputs)


def eager_compile_piece(submod: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """No compilation: the piece runs as the FX code Dynamo traced (debugging, fast tests)."""
    return submod


@dataclass
class PiecewiseBackend:
    """A `torch.compile` backend: split at `splitting_ops`, compile the pieces in between.

    `compile_piece(submodule, example_inputs)` compiles one piece (Inductor by default; tests
    may pass an eager stand-in); `wrap_piece(index, compiled, static_args)` wraps the result
    (CUDA-graph capture on GPU). `num_compiles` counts how often Dynamo handed over a graph,
    which is how tests check that new token counts do not recompile.
    """

    splitting_ops: list[str]
    compile_piece: Callable[[fx.GraphModule, list[Any]], Callable[..., Any]] = (
        inductor_compile_piece
    )
    wrap_piece: PieceWrapper = _no_wrap
    num_compiles: int = 0
    pieces: list[PieceInfo] = field(default_factory=list)
    split_gm: fx.GraphModule | None = None

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._guards import detect_fake_mode

        self.num_compiles += 1
        split_gm, pieces = split_graph(gm, self.splitting_ops)
        to_compile = {p.name for p in pieces if not p.is_splitting_op}
        fake_mode = detect_fake_mode(example_inputs)
        if fake_mode is None:
            raise RuntimeError(
                "piecewise compilation needs Dynamo's fake mode (call torch.compile)"
            )
        compiler = _PieceCompiler(
            split_gm, to_compile, self.compile_piece, self.wrap_piece, fake_mode
        )
        compiler.run(*example_inputs)
        for name, runnable in compiler.compiled.items():
            setattr(split_gm, name, _CallableModule(runnable))
        self.pieces, self.split_gm = pieces, split_gm
        logger.info(
            "piecewise compilation: %d pieces, %d of them splitting ops (run eagerly)",
            len(pieces),
            len(pieces) - len(to_compile),
        )
        return split_gm


class _CallableModule(torch.nn.Module):
    """Lets a compiled callable stand in for a submodule of the split graph."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)
