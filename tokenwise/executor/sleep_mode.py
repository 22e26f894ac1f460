"""Sleep mode of a CPU worker: the weights and the KV cache give their memory back in place.

Why in place: the runner's CPU graphs and decode kernels hold raw pointers to the weights and
to the KV cache, so moving a tensor would mean re-recording every graph. Instead each tensor's
whole pages go back to the kernel with `madvise(MADV_DONTNEED)`: the addresses stay valid (the
next touch maps fresh zero pages), the resident memory drops at once, and nothing that holds a
pointer has to know.

- Level 1 first writes the weights' bytes to a temporary file (unlinked at once, so a crash
  leaves nothing behind; `TMPDIR` picks where), and waking reads them back into the same
  addresses: the engine then computes exactly what it computed before.
- Level 2 discards the parameters (it saves only what a checkpoint does not hold: buffers
  such as rotary tables, quantized tables, adapter slots): after waking, the weights must be
  loaded again (`reload_weights`, or a trainer's push), and the engine refuses requests until
  they are.
- The KV cache is never saved: a fresh cache is zeros, which is what released pages read as.
  The engine resets its prefix cache, whose blocks' contents are gone.

oneDNN's packed copies of linear weights are opaque tensors with no address to release: they
are dropped on sleep and packed again from the restored weights on wake.
"""

from __future__ import annotations

import ctypes
import logging
import tempfile
from collections.abc import Iterable, Iterator
from typing import IO, Any

import torch
from torch import nn

from tokenwise.layers.cpu_prepack import repack_linear_weights
from tokenwise.platform import release_freed_memory, release_pages

logger = logging.getLogger("tokenwise.engine")

SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")
# How deep `model_tensors` looks into a module's non-module attributes (a quantized weight's
# parts, a list of experts' weights).
_MAX_ATTRIBUTE_DEPTH = 3

Region = tuple[int, int]  # (address, bytes) of one storage


def storage_regions(tensors: Iterable[torch.Tensor]) -> list[Region]:
    """The distinct CPU storages behind `tensors` (a view and its base count once)."""
    regions: dict[int, int] = {}
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.is_mkldnn or tensor.layout != torch.strided:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes():
            regions[storage.data_ptr()] = storage.nbytes()
    return sorted(regions.items())


def model_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor a model holds: parameters, buffers, tensor attributes of its modules, and
    the tensors of the objects its modules hold (quantized weights and their parts)."""
    for module in model.modules():
        yield from module.parameters(recurse=False)
        yield from module.buffers(recurse=False)
        for name, value in vars(module).items():
            if not name.startswith("_"):  # _parameters, _buffers, _modules: seen above
                yield from _tensors_in(value, _MAX_ATTRIBUTE_DEPTH)


def _tensors_in(value: Any, depth: int) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth == 0 or isinstance(value, (nn.Module, str, bytes, int, float, type)):
        return
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, depth - 1)
    elif type(value).__module__.startswith("tokenwise.layers") and hasattr(value, "__dict__"):
        for item in vars(value).values():
            yield from _tensors_in(item, depth - 1)


def _memory(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


class SleepState:
    """What one worker put to sleep, and how to bring it back.

    `sleep` releases the weights (saving them first at level 1) and the KV cache; `wake_up`
    brings back what its tags name. The regions are computed at sleep time from the runner's
    model and KV tensors, so a model whose weights were replaced in place sleeps the same way.
    """

    def __init__(self) -> None:
        self.level = 0
        self.asleep: set[str] = set()  # the tags still asleep
        self.weights_discarded = False  # level 2 woke up: reload before the next step
        self._backup: IO[bytes] | None = None
        self._regions: list[Region] = []
        self._packed: list[nn.Module] = []

    def sleep(self, model: nn.Module, kv_caches: Iterable[torch.Tensor], level: int) -> int:
        """Release the weights and the KV cache; returns the bytes handed back."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.asleep:
            raise RuntimeError(f"the engine is already asleep (level {self.level})")
        kv = storage_regions(kv_caches)
        kv_addresses = {address for address, _ in kv}
        self._packed = [m for m in model.modules() if getattr(m, "packed_weight", None) is not None]
        for layer in self._packed:
            layer.packed_weight = None
        release_freed_memory()  # the packed copies' heap pages, which glibc would keep
        weights = [r for r in storage_regions(model_tensors(model)) if r[0] not in kv_addresses]
        # Level 2 still keeps what a checkpoint does not hold: buffers (rotary tables),
        # quantized tables, adapter slots. Only the parameters are discarded.
        params = {address for address, _ in storage_regions(model.parameters())}
        kept = weights if level == 1 else [r for r in weights if r[0] not in params]
        try:
            self._backup = _save(kept)
        except BaseException:  # nothing released yet: stay awake as before
            repack_linear_weights(self._packed)
            raise
        released = sum(release_pages(*r) for r in weights) + sum(release_pages(*r) for r in kv)
        self._regions = kept
        self.level = level
        self.asleep = set(WAKE_TAGS)
        return released

    def wake_up(self, model: nn.Module, tags: Iterable[str] | None) -> None:
        """Bring back the tagged parts (None: all); the KV cache's pages come back as zeros on
        their next touch, so only the weights have work to do."""
        wanted = set(WAKE_TAGS if tags is None else tags)
        unknown = wanted - set(WAKE_TAGS)
        if unknown:
            raise ValueError(f"wake_up tags must be among {list(WAKE_TAGS)}, got {sorted(unknown)}")
        if "weights" in wanted & self.asleep:
            if self._backup is not None:
                _restore(self._backup, self._regions)
                self._backup.close()
                self._backup = None
            self.weights_discarded = self.level == 2
            if self._packed:
                repack_linear_weights(self._packed)
            self._packed = []
        self.asleep -= wanted
        if not self.asleep:
            self.level = 0

    def weights_loaded(self) -> None:
        """New weights were loaded whole (`reload_weights`): discarded ones are back."""
        self.weights_discarded = False


def _save(regions: list[Region]) -> IO[bytes]:
    """The regions' bytes, in order, in an unlinked temporary file (removed on close)."""
    backup = tempfile.TemporaryFile(prefix="tokenwise-sleep-")
    for address, nbytes in regions:
        backup.write(_memory(address, nbytes))
    backup.flush()
    return backup


def _restore(backup: IO[bytes], regions: list[Region]) -> None:
    backup.seek(0)
    for address, nbytes in regions:
        view = _memory(address, nbytes)
        done = 0
        while done < nbytes:
            read = backup.readinto(view[done:])
            if not read:
                raise OSError(f"the sleep backup file ended early ({done} of {nbytes} bytes)")
            done += read
