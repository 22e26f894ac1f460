"""What a quantization method is: a `QuantizationConfig` read from the checkpoint and the
setting, and the `quant_method` each linear (or MoE) layer holds and computes with.

The shape is vLLM's (`QuantizationConfig` -> `LinearMethodBase` with `create_weights`,
`process_weights_after_loading` and `apply`), so a reader who knows vLLM finds the same
seams. One difference, and why: vLLM gives each layer its method when the layer is built. In
tokenwise a layer is built dense (`UnquantizedLinearMethod.create_weights`) and gets its
method after loading, from `QuantizationConfig.process_model`, because which format a layer
ends up in often depends on the checkpoint's tensors, known only once they were read: a GGUF
file's tensor types, a GPTQ layer whose groups the kernels cannot take, the fused q/k/v parts
of a layer quantized alike or not, a tensor-parallel rank's slice. Until then the checkpoint's
format readers (`wrap_weights`, `gguf_observer`) turn the format's tensors into the dense
weights the models' loaders know, keeping the exact integers aside.

A method computes `apply(layer, x, bias)` on whatever device its weights are on: the choice of
kernel (the CPU's C kernels, a GPU kernel, or dequantizing per call) is made inside the method
and the quantized weight it holds, never by the layer or the caller.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self

import torch
from torch import nn

if TYPE_CHECKING:
    from tokenwise.layers.weight_utils import CheckpointTensor
    from tokenwise.model_config import ModelConfig

# (HF tensor name, float32 values, GGUF type name, the file's raw block bytes) -> None.
GGUFObserver = Callable[[str, torch.Tensor, str, Any], None]


class CheckpointReader(Protocol):
    """A format's reader: its layers' tensors in, dense weights out, the format kept aside."""

    def wrap(
        self, weights: Iterable[tuple[str, CheckpointTensor]], names: Iterable[str]
    ) -> Iterable[tuple[str, CheckpointTensor]]: ...


class QuantizeMethodBase(ABC):
    """How one layer holds and uses its weights. Methods hold no per-layer state (the layer
    does), so one instance may serve every layer of its kind."""

    def create_weights(self, layer: nn.Module, *args: Any, **kwargs: Any) -> None:
        """Create the layer's checkpoint-loadable parameters."""
        raise NotImplementedError(f"{type(self).__name__} does not create weights")

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027
        """Turn the loaded parameters into the form `apply` computes with (a no-op here)."""

    @abstractmethod
    def apply(self, layer: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The layer's output."""


class LinearMethodBase(QuantizeMethodBase):
    """A linear layer's method: `apply(layer, x, bias)` is `x @ W^T + bias`."""

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`x @ W^T + bias` in x's dtype, W being the layer's weight in this method's form."""


class FusedMoEMethodBase(QuantizeMethodBase):
    """An MoE layer's routed experts: `apply` runs the experts the router picked."""

    @abstractmethod
    def apply(
        self,
        layer: nn.Module,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """This rank's partial output: each token's experts' outputs, weighted and summed."""


def is_linear(module: nn.Module) -> bool:
    """Whether `module` is a linear layer (it holds a linear method): every parallel kind of
    `ReplicatedLinear` and the LM head."""
    return isinstance(getattr(module, "quant_method", None), LinearMethodBase)


class QuantizationConfig(ABC):
    """One model's quantization (vLLM's `QuantizationConfig`), built once per load by
    `from_model_config`. Subclasses are registered by name in `registry.QUANTIZATION_METHODS`.

    The loader calls, in order: `wrap_weights` over a safetensors checkpoint's tensors (or
    `gguf_observer` while a GGUF file is read), the model's own `load_weights`, then
    `process_model`, which gives the layers their methods.
    """

    name: ClassVar[str]

    def __init__(self, model_config: ModelConfig, device: torch.device) -> None:
        self.model_config = model_config
        self.device = device
        self.reader: Any = None  # the format's reader, once a checkpoint was wrapped

    @classmethod
    def from_model_config(cls, model_config: ModelConfig, device: torch.device) -> Self:
        """The config for `model_config` (its `quantization` and checkpoint) on `device`;
        errors name the checkpoint field or the setting at fault."""
        return cls(model_config, device)

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def make_reader(self, model: nn.Module) -> CheckpointReader | None:
        """The format's reader of a safetensors checkpoint for `model`; None: read as is."""
        return None

    def wrap_weights(
        self,
        model: nn.Module,
        weights: Iterable[tuple[str, CheckpointTensor]],
        names: Callable[[], set[str]],
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """The checkpoint's `(name, tensor)` stream as the model's loader reads it: the format's
        reader (`make_reader`, kept in `self.reader` for `process_model`) turns its layers'
        tensors into dense weights here (`names()`: every tensor name of the checkpoint, read
        from the headers only when asked)."""
        self.reader = self.make_reader(model)
        return weights if self.reader is None else self.reader.wrap(weights, names())

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method an MoE layer (named `prefix`) is built with, asked while the model is
        built (`building_with`); None: the layer's dense method. Linear layers are always
        built dense: their format is known only from the checkpoint's tensors."""
        return None

    def gguf_observer(self, model: nn.Module) -> GGUFObserver | None:
        """A hook that sees each GGUF tensor's values and type as the file is read; None."""
        return None

    @abstractmethod
    def process_model(self, model: nn.Module) -> None:
        """After loading: give each layer its method (and its weights that method's form)."""


_building: QuantizationConfig | None = None  # the config of the model being built


@contextmanager
def building_with(config: QuantizationConfig) -> Iterator[None]:
    """Make `config` the one layers ask for their method (`method_at_build`) while built."""
    global _building
    previous, _building = _building, config
    try:
        yield
    finally:
        _building = previous


def method_at_build(layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
    """The method the config of the model being built gives `layer`; None outside a build
    (a layer built on its own, in a test) or where the config leaves it dense."""
    return None if _building is None else _building.get_quant_method(layer, prefix)
