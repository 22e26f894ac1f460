"""torch.compile of a token-wise model: one full graph, or piecewise around attention.

The attention op `tokenwise::unified_attention` is a `torch.library` custom op with a fake
implementation, so Dynamo traces the whole model as one graph in which every attention call is a
single opaque node: nothing about batching, metadata or the KV cache is traced, and the same
compiled code serves every batch shape (the token dimension is dynamic). The pieces between
attention calls are what Inductor fuses (norms, rotary, activation, residual adds).

Two shapes of compiled model:
- full graph (`torch.compile(..., fullgraph=True)` with Inductor): the simplest, used on CPU
  and whenever no piecewise CUDA graphs are wanted;
- piecewise (`tokenwise.compilation.piecewise`): the graph is cut at every splitting op and
  each piece compiled on its own, so that on a GPU each piece can be captured as a CUDA graph.

Dynamic token count, compiled once: Dynamo specialises sizes 0 and 1 of ordinary symbolic
sizes, and reshapes of non-contiguous tensors guard on "size != 1", so a batch of a single token
(one decoding sequence) would trigger a second compilation. The token dimension of the inputs is
therefore marked *unbacked*: the compiled code makes no assumption about its value and carries no
guard on it, so any count, 1 included, reuses it. `specialize_float` bakes float attributes (norm
epsilons, scales) in as constants, which avoids Inductor restarting Dynamo's analysis to
specialise them later; it applies only while this model is traced.

One Dynamo cache per engine: Dynamo keeps compiled code on the code object of the function it
compiled, and `Model.forward` is one code object for every instance of a model class. Each new
engine's model fails the previous engines' guards (another module, maybe another dtype) and
adds an entry, until the eighth engine in one process hits Dynamo's recompile limit and
`fullgraph=True` turns that into an error (found on a GPU, where tests and `gpu_check` build
many compiled engines). So each model is compiled through a private copy of its class's
`forward` code: its cache lives and dies with that model.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from tokenwise.compilation.piecewise import (
    PiecewiseBackend,
    PieceWrapper,
    eager_compile_piece,
    inductor_compile_piece,
)
from tokenwise.config import CompilationConfig

logger = logging.getLogger(__name__)


@contextmanager
def dynamic_token_tracing() -> Iterator[None]:
    """The Dynamo settings under which a model is traced (see the module docstring)."""
    with torch._dynamo.config.patch(specialize_float=True):
        yield


def mark_token_dim_unbacked(*args: Any) -> None:
    """Mark dim 0 (tokens) of every tensor argument as an unbacked dynamic size."""
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() > 0:
            torch._dynamo.decorators.mark_unbacked(arg, 0)


class CompiledModel(nn.Module):
    """The compiled forward of `model`; every other attribute is the original model's.

    `compute_logits`, `load_weights` and the like reach the original module, so the engine can
    treat a compiled model like the eager one. `backend` is the piecewise backend (None for a
    full graph), which exposes the pieces and how often Dynamo compiled.
    """

    def __init__(
        self, model: nn.Module, compiled: Any, backend: PiecewiseBackend | None = None
    ) -> None:
        super().__init__()
        self.model = model
        self._compiled = compiled
        self.backend = backend

    @property
    def piecewise(self) -> bool:
        return self.backend is not None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        mark_token_dim_unbacked(*args)
        with dynamic_token_tracing():
            return self._compiled(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)


def own_forward(model: nn.Module) -> Callable[..., Any]:
    """`model.forward` bound to a private copy of its code object (see the module docstring)."""
    function = type(model).forward
    code = function.__code__.replace()  # a distinct object: Dynamo's cache is per code object
    private = types.FunctionType(
        code, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
    private.__kwdefaults__ = function.__kwdefaults__
    return types.MethodType(private, model)


def compile_model(
    model: nn.Module,
    compilation: CompilationConfig | None = None,
    wrap_piece: PieceWrapper | None = None,
) -> CompiledModel:
    """Compile `model.forward`, dynamic in the number of tokens, with no graph breaks allowed.

    Piecewise when `compilation.use_piecewise_compile` says so; `wrap_piece` then wraps every
    compiled piece (the CUDA-graph runner passes its capture/replay wrapper). The first call
    pays the compile, and later calls with any token count reuse it.
    """
    compilation = compilation or CompilationConfig()
    if not compilation.use_piecewise_compile:
        logger.info("compiling the model with torch.compile (one graph, dynamic token dimension)")
        compiled = torch.compile(own_forward(model), dynamic=True, fullgraph=True)
        return CompiledModel(model, compiled)
    compile_piece = (
        inductor_compile_piece if compilation.piece_backend == "inductor" else eager_compile_piece
    )
    backend = PiecewiseBackend(list(compilation.splitting_ops), compile_piece)
    if wrap_piece is not None:
        backend.wrap_piece = wrap_piece
    logger.info(
        "compiling the model piecewise (split at %s, pieces by %s)",
        ", ".join(compilation.splitting_ops),
        compilation.piece_backend,
    )
    compiled = torch.compile(own_forward(model), backend=backend, dynamic=True, fullgraph=True)
    return CompiledModel(model, compiled, backend)
