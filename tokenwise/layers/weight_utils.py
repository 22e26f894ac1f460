"""Copying checkpoint tensors into parameters: the part of weight loading that models call.

A model's `load_weights` routes each Hugging Face tensor to a parameter (or to one shard of a
fused parameter) through `load_stacked_weights`; the layers' `weight_loader`s do the copies with
`copy_checked`. These helpers live here, next to the layers and below the models, rather than
in `tokenwise.loader`: the loader resolves the model class, so it sits *above* the models, and
a model importing it would close an import circle.

Loading is strict. A checkpoint tensor the model does not know, a parameter the checkpoint does
not provide and a shape mismatch are all errors that name the tensors involved, because a
silently half-loaded model produces plausible-looking garbage that is far harder to debug.

Under tensor parallelism a loader receives the *full* checkpoint tensor and copies this rank's
slice. The tensor may be a `LazyTensor` (a safetensors slice not read yet): `narrow` and
indexing on it read only the rows / columns asked for, so a rank never materialises the tensors
it holds a slice of. `copy_checked` reads whatever is left, after checking the shape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

# (fused parameter component, checkpoint component, shard id), e.g. ("qkv_proj", "q_proj", "q").
StackedMapping = Sequence[tuple[str, str, str | int]]


class _Sliceable(Protocol):
    """What `safe_open(...).get_slice(name)` returns: a shape, and reads of index ranges."""

    def get_shape(self) -> list[int]: ...

    def get_dtype(self) -> str: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


class LazyTensor:
    """A checkpoint tensor (or a box of it, after `narrow`) that is read only when needed.

    It offers the few tensor operations weight loaders use on checkpoint tensors: `shape`,
    `dim()`, `narrow()` (lazy) and basic indexing with ints and step-1 slices (reads that part).
    `materialize()` reads the whole box; an unnarrowed tensor is read with `read_full`, exactly
    as a plain load would read it. Valid only while the file it comes from is open.
    """

    def __init__(
        self,
        source: _Sliceable,
        read_full: Callable[[], torch.Tensor],
        box: tuple[slice, ...] | None = None,
    ) -> None:
        self._source = source
        self._read_full = read_full
        self._full_shape = tuple(int(n) for n in source.get_shape())
        self._box = box if box is not None else tuple(slice(0, n) for n in self._full_shape)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(s.stop - s.start for s in self._box)

    def dim(self) -> int:
        return len(self._box)

    @property
    def stored_dtype(self) -> str:
        """The file's dtype name (safetensors': "BF16", "F8_E4M3", ...), read from its header."""
        return self._source.get_dtype()

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        dim = dim % self.dim() if self.dim() else dim
        size = self.shape[dim]
        if not (0 <= start and 0 <= length and start + length <= size):
            raise IndexError(f"narrow({dim}, {start}, {length}) is out of range for size {size}")
        box = list(self._box)
        first = box[dim].start + start
        box[dim] = slice(first, first + length)
        return LazyTensor(self._source, self._read_full, tuple(box))

    def materialize(self) -> torch.Tensor:
        if all(
            s.start == 0 and s.stop == n for s, n in zip(self._box, self._full_shape, strict=True)
        ):
            return self._read_full()
        return self._source[self._box]

    def __getitem__(self, index: Any) -> torch.Tensor:
        """Read `self[index]` for ints and step-1 slices (anything else reads the whole box)."""
        items = index if isinstance(index, tuple) else (index,)
        if len(items) > self.dim() or not all(
            isinstance(i, int) or (isinstance(i, slice) and i.step in (None, 1)) for i in items
        ):
            return self.materialize()[index]
        box, drop = list(self._box), []
        for dim, item in enumerate(items):
            lo, hi = box[dim].start, box[dim].stop
            if isinstance(item, int):
                pos = item + (hi - lo) if item < 0 else item
                if not 0 <= pos < hi - lo:
                    raise IndexError(f"index {item} is out of range for size {hi - lo}")
                box[dim], drop = slice(lo + pos, lo + pos + 1), [*drop, dim]
            else:
                start, stop, _ = item.indices(hi - lo)
                box[dim] = slice(lo + start, lo + max(start, stop))
        part = LazyTensor(self._source, self._read_full, tuple(box)).materialize()
        for dim in reversed(drop):
            part = part.squeeze(dim)
        return part

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)})"


# A checkpoint tensor as weight loaders receive it: read already, or on demand.
CheckpointTensor = torch.Tensor | LazyTensor


def materialize(loaded: CheckpointTensor) -> torch.Tensor:
    return loaded.materialize() if isinstance(loaded, LazyTensor) else loaded


def check_full_shape(loaded: CheckpointTensor, expected: Sequence[int]) -> None:
    """Refuse a checkpoint tensor whose full shape is not `expected` (before slicing it: a slice
    of a wrongly sized tensor could still fit the shard)."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(
            f"shape mismatch: the model expects {tuple(expected)}, "
            f"the checkpoint has {tuple(loaded.shape)}"
        )


def copy_checked(param: torch.Tensor, loaded: CheckpointTensor) -> None:
    """Copy `loaded` into `param` (casting dtype and device), refusing to broadcast.

    `Tensor.copy_` would happily broadcast a `[1, n]` tensor into `[m, n]`, hiding a wrong
    checkpoint, so shapes are compared explicitly (before a lazy tensor is read).
    """
    check_full_shape(loaded, param.shape)
    with torch.no_grad():
        param.copy_(materialize(loaded))


def default_weight_loader(
    param: torch.Tensor, loaded_weight: CheckpointTensor, shard_id: object = None
) -> None:
    """The loader of a parameter that is not fused: a checked whole-tensor copy."""
    if shard_id is not None:
        raise ValueError(f"this parameter is not fused; got shard id {shard_id!r}")
    copy_checked(param, loaded_weight)


def deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """`[E, 2I, ...]` rows `g0, u0, g1, u1, ...` -> gate rows, then up rows (gpt-oss stores
    its experts' gate and up units interleaved; the fused layers keep the halves apart)."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def _map_name(name: str, mapping: StackedMapping) -> tuple[str, str | int | None]:
    parts = name.split(".")
    for fused, ckpt, shard in mapping:
        if ckpt in parts:
            return ".".join(fused if p == ckpt else p for p in parts), shard
    return name, None


def checkpoint_names(param_name: str, mapping: StackedMapping) -> dict[str | int | None, str]:
    """The checkpoint tensor behind each shard of a parameter (itself when not fused)."""
    parts = param_name.split(".")
    names = {
        shard: ".".join(ckpt if p == fused else p for p in parts)
        for fused, ckpt, shard in mapping
        if fused in parts
    }
    return names or {None: param_name}


def load_stacked_weights(
    model: nn.Module, weights: Iterable[tuple[str, CheckpointTensor]], mapping: StackedMapping
) -> set[str]:
    """Copy checkpoint tensors into `model`, routing the ones in `mapping` to fused shards.

    Returns the parameters that were filled completely: a fused one only when all its shards
    arrived, so a checkpoint lacking just `k_proj` is caught as a missing tensor.
    """
    params = dict(model.named_parameters())
    shards_seen: dict[str, set[str | int | None]] = {}
    for name, tensor in weights:
        target, shard = _map_name(name, mapping)
        param = params.get(target)
        if param is None:
            raise ValueError(
                f"checkpoint tensor {name!r} does not match any parameter of {type(model).__name__}"
            )
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"cannot load checkpoint tensor {name!r} into {target!r}: {e}") from e
        shards_seen.setdefault(target, set()).add(shard)
    loaded: set[str] = set()
    partial: list[str] = []
    for target, seen in shards_seen.items():
        needed = checkpoint_names(target, mapping)
        partial += [ckpt for shard, ckpt in needed.items() if shard not in seen]
        if seen >= needed.keys():
            loaded.add(target)
    if partial:
        raise ValueError(
            f"checkpoint for {type(model).__name__} is missing tensors: {', '.join(sorted(partial))}"
        )
    return loaded
