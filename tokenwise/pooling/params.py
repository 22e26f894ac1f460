"""`PoolingParams`: what one embedding request asks for (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """Per-request settings of `LLM.embed` and `/v1/embeddings`.

    `normalize`: None keeps the model's pooler config (from sentence-transformers files, or the
    default); True / False override it for this request. `dimensions`: a shorter embedding
    (Matryoshka truncation). No tokenwise model declares Matryoshka dimensions yet, so any
    value is refused by the engine with an error naming the parameter, never silently ignored.
    """

    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be True, False or None, got {self.normalize!r}")
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")

    def verify(self, model_name: str) -> None:
        """Refuse what this model cannot do (called when the request is added)."""
        if self.dimensions is not None:
            raise ValueError(
                f"dimensions={self.dimensions} is not supported: model {model_name!r} declares "
                "no Matryoshka dimensions, so its embeddings cannot be shortened; omit dimensions"
            )
