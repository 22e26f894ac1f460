"""Calls into the C kernels, recordable for a CPU graph (`tokenwise.compilation.cpu_graph`).

At one token per step a decoder layer is a handful of C kernel calls (RMSNorm, the quantized or
small-M linear layers, RoPE, the attention step, the gated activation) glued by Python: module
calls, eligibility checks, allocations, ctypes argument conversion. On the 100M Llama shape
the glue took as long as the kernels. A CPU graph runs the forward once with recording on,
keeps every call's function and arguments (addresses into tensors that stay alive, integers,
floats), and replays the list from C afterwards: the kernels run, the glue does not.

So every kernel call that a decode step makes goes through `call(lib, name, *args)`: it calls
`lib.<name>(*args)` as ctypes would, and while a `recording()` is open also appends the call,
its arguments packed into int64s by the function's declared `argtypes` (pointers and integers
as they are, a float's bits in the low half), to the recording. The replay calls
`lib.<name>_packed`, the kernel's entry that unpacks that array (every C kernel file has one
per recordable kernel). Outside a recording the cost is one global read.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

_recording: Recording | None = None


@dataclass
class RecordedCall:
    name: str
    entry: int  # address of the kernel's `_packed` entry
    args: list[int]


@dataclass
class Recording:
    """The kernel calls made while it was open, in order."""

    calls: list[RecordedCall] = field(default_factory=list)

    def add(self, lib: ctypes.CDLL, name: str, fn: Any, args: tuple[Any, ...]) -> None:
        packed = getattr(lib, name + "_packed", None)
        if packed is None:
            raise NotImplementedError(f"kernel {name!r} has no packed entry: it cannot be replayed")
        types = fn.argtypes or ()
        if len(types) != len(args):
            raise TypeError(f"kernel {name!r} takes {len(types)} arguments, got {len(args)}")
        entry = ctypes.cast(packed, ctypes.c_void_p).value
        assert entry is not None
        self.calls.append(
            RecordedCall(name, entry, [_pack(t, a) for t, a in zip(types, args, strict=True)])
        )


def _pack(argtype: Any, value: Any) -> int:
    if value is None:
        return 0
    if argtype in (ctypes.c_float, ctypes.c_double):
        return struct.unpack("<I", struct.pack("<f", float(value)))[0]
    return int(value)


def call(lib: ctypes.CDLL, name: str, *args: Any) -> Any:
    """`lib.<name>(*args)`, recorded when a recording is open."""
    fn = getattr(lib, name)
    if _recording is not None:
        _recording.add(lib, name, fn, args)
    return fn(*args)


def ptrs(*tensors: Any) -> list[int | None]:
    """The tensors' data pointers, as a kernel takes them (None for an absent tensor)."""
    return [None if t is None else t.data_ptr() for t in tensors]


def is_recording() -> bool:
    return _recording is not None


@contextmanager
def recording() -> Iterator[Recording]:
    """Record the kernel calls made inside the block (one recording at a time)."""
    global _recording
    if _recording is not None:
        raise RuntimeError("a kernel recording is already open")
    _recording = Recording()
    try:
        yield _recording
    finally:
        _recording = None
