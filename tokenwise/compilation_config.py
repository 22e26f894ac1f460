"""torch.compile and CUDA-graph settings: `CUDAGraphMode` and `CompilationConfig`.

Apart from the rest of the engine configuration (`tokenwise/config.py`, which re-exports both)
because the graph code reads them on every step and they are a concept of their own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


def _check_capture_size(size: Any) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"cudagraph_capture_sizes entries must be an integer >= 1, got {size!r}")


class CUDAGraphMode(enum.Enum):
    """How a forward pass is replayed from captured graphs.

    The two tuple modes name a (decode, mixed) pair: uniform-decode batches and mixed batches
    are dispatched through separate routines. Only the three plain modes are valid at run time.
    """

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def separate_routine(self) -> bool:
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        return mode in (self.decode_mode(), self.mixed_mode())

    def has_full_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.FULL)

    def requires_piecewise_compilation(self) -> bool:
        return self.has_mode(CUDAGraphMode.PIECEWISE)

    def valid_runtime_modes(self) -> bool:
        """True for the modes a single forward pass can run in (NONE, PIECEWISE, FULL)."""
        return self in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)

    @classmethod
    def parse(cls, value: str | int | CUDAGraphMode) -> CUDAGraphMode:
        """Accept an enum member, its name in any case (as typed on a command line) or an int."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().upper()
            if key in cls.__members__:
                return cls[key]
            raise ValueError(
                f"cudagraph_mode must be one of {', '.join(cls.__members__)} "
                f"(case-insensitive), got {value!r}"
            )
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(value)
        raise ValueError(f"cudagraph_mode must be a CUDAGraphMode or its name, got {value!r}")


PIECE_BACKENDS = ("inductor", "eager")


@dataclass
class CompilationConfig:
    """torch.compile and CUDA-graph settings, plus the static registry of no-compile layers.

    `static_forward_context` maps a layer's module path to the layer itself. Attention layers
    fill it at construction; the forward context hands the *same dict* to the custom op, which
    is how an opaque op finds its layer (and KV cache) from a name.
    """

    static_forward_context: dict[str, Any] = field(default_factory=dict)
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE
    cudagraph_capture_sizes: list[int] | None = None
    use_compile: bool = False
    # Opaque ops the compiled graph is cut at (piecewise graphs never hold them): attention
    # (MLA's too), and the MoE experts, whose per-expert token counts are read on the host.
    splitting_ops: list[str] = field(
        default_factory=lambda: [
            "tokenwise::unified_attention",
            "tokenwise::mla_attention",
            "tokenwise::moe_experts",
        ]
    )
    # None: split the graph at `splitting_ops` exactly when the CUDA-graph mode has piecewise
    # graphs; True / False force piecewise / one full graph.
    piecewise_compile: bool | None = None
    # How the pieces between attention calls are compiled: "inductor", or "eager" (traced and
    # split but run as plain FX code: a debugging aid that isolates Inductor from the rest).
    piece_backend: str = "inductor"

    def __post_init__(self) -> None:
        self.cudagraph_mode = CUDAGraphMode.parse(self.cudagraph_mode)
        if self.piece_backend not in PIECE_BACKENDS:
            raise ValueError(
                f"piece_backend must be one of {', '.join(PIECE_BACKENDS)}, "
                f"got {self.piece_backend!r}"
            )
        if self.cudagraph_capture_sizes is not None:
            sizes = list(self.cudagraph_capture_sizes)
            for size in sizes:
                _check_capture_size(size)
            self.cudagraph_capture_sizes = sorted(set(sizes))
        self._padded_size_table: list[int] | None = None
        self._padded_size_table_for: list[int] | None = None

    @property
    def use_piecewise_compile(self) -> bool:
        """Whether `torch.compile` splits the graph at the splitting ops."""
        if self.piecewise_compile is not None:
            return self.piecewise_compile
        return self.cudagraph_mode.requires_piecewise_compilation()

    @property
    def max_capture_size(self) -> int:
        return self.cudagraph_capture_sizes[-1] if self.cudagraph_capture_sizes else 0

    def pad_for_cudagraph(self, num_tokens: int) -> int | None:
        """Smallest capture size >= num_tokens, or None when the batch is too large for any graph.

        A lookup table makes this O(1) on the per-step path. It is rebuilt when the capture
        sizes were reassigned after construction (the engine may fill them in later), so a
        stale table never answers for a different list. Reassigned lists must stay ascending.
        """
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if num_tokens > self.max_capture_size:
            return None
        if (
            self._padded_size_table is None
            or self._padded_size_table_for != self.cudagraph_capture_sizes
        ):
            table = [0] * (self.max_capture_size + 1)
            sizes = self.cudagraph_capture_sizes or []
            idx = 0
            for b in range(1, self.max_capture_size + 1):
                while sizes[idx] < b:
                    idx += 1
                table[b] = sizes[idx]
            self._padded_size_table = table
            self._padded_size_table_for = list(sizes)
        return self._padded_size_table[num_tokens]


# vLLM's `kv_cache_dtype` values: "fp8" is "fp8_e4m3" (more precision, less range than e5m2).
