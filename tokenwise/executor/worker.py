"""One rank of an engine: its device, its process-group membership and one model runner.

The executor builds the driver's worker in the engine's process; every other rank builds its
own in its process (`worker_main.py`) after joining the groups. Both then run the same
start-up sequence (`start`: build the runner, agree on the KV block count, allocate), so the
ranks' start-up collectives line up by construction.

A worker other than the driver has no scheduler: `serve` runs the driver's messages until it is
told to stop. The messages are tuples whose first item names them: `step` (a `StepMessage`),
`dummy` (a DP rank's empty forward), `restore` (a recurrent model's rollback after
verification), `rpc` (a method every worker runs, `collective_rpc`) and `stop`; a pipeline
stage's loop is the runner's pipeline part's (`PipelineStages.serve`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from tokenwise.config import EngineConfig
from tokenwise.distributed.pp_channel import PipelineChannel
from tokenwise.distributed.startup import start_runner
from tokenwise.distributed.tp_broadcast import gather_replies
from tokenwise.distributed.tp_channel import TPDriver
from tokenwise.distributed.tp_state import get_tp_cpu_group, get_tp_rank
from tokenwise.distributed.weight_transfer import (
    DEFAULT_TIMEOUT_S,
    drain,
    join_weight_group,
    receive_weights,
)
from tokenwise.engine.step_outputs import ModelRunnerOutput, SchedulerOutput
from tokenwise.executor.sleep_mode import SleepState
from tokenwise.layers.cpu_prepack import repack_linear_weights
from tokenwise.loader import (
    _check_complete,
    load_weights_in_place,
    quantized_layer_names,
    reload_weights_from,
)
from tokenwise.platform import configure_cpu_allocator
from tokenwise.runner.kind_part import RunnerKindPart
from tokenwise.runner.model_runner import ModelRunner

logger = logging.getLogger("tokenwise.engine")

# What `collective_rpc` runs: a method name of `Worker`, or a function called as f(worker, ...).
RPCMethod = str | Callable[..., Any]


def run_rpc(worker: Worker, method: RPCMethod, args: tuple, kwargs: dict[str, Any]) -> Any:
    """Call `method` on `worker`; an unknown name is a clear error, not an AttributeError."""
    if callable(method):
        return method(worker, *args, **kwargs)
    target = getattr(worker, method, None)
    if target is None or method.startswith("_") or not callable(target):
        raise ValueError(f"collective_rpc: the worker has no method {method!r}")
    return target(*args, **kwargs)


class Worker:
    """One rank: `device`, the TP (and pipeline) channel it joined, and `runner` once started.

    `kind_part` is what the model kind adds to the runner's step, on the driver (a worker rank
    runs the plain decoder step: a kind's extra inputs run on the driver only); `pipeline` is
    the channel between stages when the engine is a pipeline (its runner then holds a
    `PipelineStages` part).
    """

    def __init__(
        self,
        config: EngineConfig,
        device: str | torch.device,
        tp: TPDriver,
        kind_part: type[RunnerKindPart] = RunnerKindPart,
        pipeline: PipelineChannel | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.tp = tp
        self.pipeline = pipeline
        self.kind_part = kind_part
        self.runner: Any = None
        self.num_blocks = 0
        self.sleep_state = SleepState()  # sleep mode (`sleep`, `wake_up`)
        self.weight_group: Any = None  # a trainer's group (`init_weight_update_group`)
        self.init_device()

    @property
    def rank(self) -> int:
        """This worker's TP rank (0: the driver)."""
        return get_tp_rank()

    def init_device(self) -> None:
        """CPU: the allocator tuned for decode (huge pages, tcmalloc-like reuse); CUDA: the
        device made current, so every tensor this rank creates lands on it."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            configure_cpu_allocator()

    def start(
        self,
        on_runner: Callable[[Any], None] | None = None,
        check_num_blocks: Callable[[int], None] | None = None,
    ) -> int:
        """The start-up sequence (`distributed/startup.py`); returns the agreed block count.
        `on_runner(runner)` runs once the runner exists, before the collectives that follow
        (the engine builds its model kind there)."""

        def make_runner() -> Any:
            self.runner = ModelRunner(
                self.config, self.device, self.tp, self.kind_part, self.pipeline
            )
            if on_runner is not None:
                on_runner(self.runner)
            return self.runner

        _, self.num_blocks = start_runner(make_runner, check_num_blocks)
        return self.num_blocks

    # ---- the driver ---------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def execute_dummy_batch(self, num_tokens: int = 1) -> None:
        self.runner.execute_dummy_batch(num_tokens)

    # ---- every other rank ---------------------------------------------------------------------

    @torch.inference_mode()
    def serve(self) -> None:
        """Run the driver's messages until it says stop (a rank other than the driver)."""
        if self.runner.pipeline is not None:
            self.runner.pipeline.serve()
            return
        while True:
            message = self.tp.receive()
            kind = message[0]
            if kind == "stop":
                return
            if kind == "dummy":
                self.runner.execute_dummy_batch(message[1])
            elif kind == "restore":
                self.runner.recurrent.restore(message[1])
            elif kind == "rpc":
                self._answer_rpc(*message[1:])
            else:
                self.runner.execute_worker_step(message[1])

    def _answer_rpc(self, method: RPCMethod, args: tuple, kwargs: dict[str, Any]) -> None:
        """Run an RPC and send the driver its result, or the error (the driver raises it)."""
        try:
            reply: tuple[bool, Any] = (True, run_rpc(self, method, args, kwargs))
        except Exception as exc:  # the worker serves on; the caller sees what went wrong
            reply = (False, f"{type(exc).__name__}: {exc}")
        gather_replies(reply, get_tp_cpu_group())

    # ---- methods callers reach through `collective_rpc` ---------------------------------------

    def check_health(self) -> None:
        """Raises when this rank cannot serve (its runner is gone)."""
        if self.runner is None:
            raise RuntimeError(f"rank {self.rank} has no runner")

    def sleep(self, level: int = 1) -> int:
        """Release the weights (saved to a file first at level 1) and the KV cache
        (`sleep_mode.py`); returns the bytes handed back."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep needs an engine started with enable_sleep_mode=True")
        if level == 2 and quantized_layer_names(self.runner.model):
            raise ValueError(
                "sleep level 2 discards weights that could not be loaded again: this model "
                "has quantized layers, which weight updates refuse; use level 1"
            )
        return self.sleep_state.sleep(self.runner.model, self.runner.kv_caches.values(), level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what `tags` name ("weights", "kv_cache"; None: both)."""
        self.sleep_state.wake_up(self.runner.model, tags)

    def reload_weights(self, path: str | None = None) -> int:
        """Load a safetensors checkpoint directory (default: the engine's model) into the
        loaded model in place; returns the parameters filled (this rank's shards)."""
        self._check_weights_awake()
        assert self.config.model is not None
        loaded = reload_weights_from(self.runner.model, path or self.config.model.model)
        self._weights_changed()
        return loaded

    def init_weight_update_group(
        self, host: str, port: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        """Join a trainer's group (`distributed/weight_transfer.py`) as rank 1 + this TP rank."""
        self.weight_group = join_weight_group(host, port, 1 + self.rank, world_size, timeout_s)

    def receive_weights(self) -> int:
        """Receive the trainer's next transfer into the model; returns the tensors received."""
        if self.weight_group is None:
            raise RuntimeError("no trainer group: call init_weight_update_group first")
        self._check_weights_awake()
        received = receive_weights(self.weight_group)
        count = 0

        def counted() -> Any:
            nonlocal count
            for item in received:
                count += 1
                yield item

        discarded = self.sleep_state.weights_discarded
        try:
            loaded = load_weights_in_place(self.runner.model, counted())
        finally:
            drain(received)  # a refused tensor: the trainer still finishes sending
            self._repack()
        if discarded:  # after a level-2 sleep every parameter must have come
            _check_complete(self.runner.model, loaded)
        self.sleep_state.weights_loaded()
        return count

    def _check_weights_awake(self) -> None:
        if "weights" in self.sleep_state.asleep:
            raise RuntimeError("the weights are asleep: wake_up(tags=['weights']) first")

    def _weights_changed(self) -> None:
        self.sleep_state.weights_loaded()
        self._repack()

    def _repack(self) -> None:
        """New values are in the weights: oneDNN's packed copies are made again from them."""
        model = self.runner.model
        repack_linear_weights(
            [m for m in model.modules() if getattr(m, "packed_weight", None) is not None]
        )

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.shutdown()
