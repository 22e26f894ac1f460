"""The executor: it owns an engine's workers, from start-up to shutdown.

The engine talks to the model only through its executor: `execute_model` (the driver worker
runs the step; under tensor parallelism its runner broadcasts the step's message to the other
ranks, which run the same forward pass), `execute_dummy_batch`, `collective_rpc` (a method on
every worker, results in rank order) and `shutdown`. Two backends today:

- `UniProcExecutor`: one worker, in the engine's process (no parallelism);
- `MultiprocExecutor`: the driver's worker in the engine's process and the other ranks in
  processes it spawned (or that torchrun started), joined over torch.distributed (gloo on CPU,
  NCCL on GPU). It keeps the spawned processes' handles: every wait on them checks that they
  live, and shutting down (or dropping the engine) stops them.
- `RayExecutor`: the same, with the other ranks as Ray actors in a placement group
  (`distributed_executor_backend="ray"`, `ray_workers.py`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokenwise.config import EngineConfig
from tokenwise.distributed.lifecycle import ensure_clean_parallel_state
from tokenwise.distributed.pp_channel import PipelineChannel
from tokenwise.distributed.pp_launch import start_pipeline_parallel
from tokenwise.distributed.rendezvous import WorkerLostError
from tokenwise.distributed.tp_broadcast import gather_replies
from tokenwise.distributed.tp_channel import TPDriver
from tokenwise.distributed.tp_launch import TPWorkers, start_tensor_parallel
from tokenwise.distributed.tp_state import ACTIVATION_TIMEOUT_S, get_tp_cpu_group
from tokenwise.engine.step_outputs import ModelRunnerOutput, SchedulerOutput
from tokenwise.executor.ray_workers import RayWorkers
from tokenwise.executor.worker import RPCMethod, Worker, run_rpc
from tokenwise.executor.worker_main import run_pp_worker, run_tp_worker
from tokenwise.runner.kind_part import RunnerKindPart


@dataclass
class StartUp:
    """What starting an engine's workers needs: the config and device, the model kind's part
    of the runner, what the engine does once the runner exists (`on_runner`, before KV sizing)
    and its check of the agreed block count."""

    config: EngineConfig
    device: str | torch.device
    kind_part: type[RunnerKindPart] = RunnerKindPart
    on_runner: Callable[[Any], None] | None = None
    check_num_blocks: Callable[[int], None] | None = None


@dataclass
class RPCCall:
    """One `collective_rpc` call: `method(worker, *args, **kwargs)` on every rank."""

    method: RPCMethod
    args: tuple
    kwargs: dict[str, Any]
    timeout: float | None

    @property
    def name(self) -> str:
        method = self.method
        return method if isinstance(method, str) else getattr(method, "__name__", "a function")


class Executor:
    """The interface the engine drives, and what every backend shares (the driver worker)."""

    def __init__(self, config: EngineConfig, driver_worker: Worker) -> None:
        self.config = config
        self.driver_worker = driver_worker

    @staticmethod
    def create(
        config: EngineConfig,
        device: str | torch.device,
        kind_part: type[RunnerKindPart] = RunnerKindPart,
        on_runner: Callable[[Any], None] | None = None,
        check_num_blocks: Callable[[int], None] | None = None,
    ) -> Executor:
        """Start the workers the config asks for and run the start-up sequence on them."""
        ensure_clean_parallel_state()  # no dropped engine's workers or groups left behind
        parallel = config.parallel
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size == 1:
            cls: type[Executor] = UniProcExecutor
        elif parallel.distributed_executor_backend == "ray":
            cls = RayExecutor
        else:
            cls = MultiprocExecutor
        return cls.start(StartUp(config, device, kind_part, on_runner, check_num_blocks))

    @classmethod
    def start(cls, s: StartUp) -> Executor:
        raise NotImplementedError

    @property
    def runner(self) -> Any:
        """The driver worker's runner (the engine reads its model, LoRA manager, layout)."""
        return self.driver_worker.runner

    @property
    def num_blocks(self) -> int:
        """KV-cache blocks every rank allocated (per virtual engine under PP)."""
        return self.driver_worker.num_blocks

    @property
    def is_collective(self) -> bool:
        """Whether a failed step may leave other ranks inside a collective (no retry)."""
        return False

    def check_health(self) -> None:
        """Raise, naming it, when a worker process or actor has died (vLLM's name). The engine
        core calls it while idle, so a rank lost between requests ends the engine (a server
        answers 503 and exits) instead of waiting for the next request to find out."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute_model(scheduler_output)

    def execute_dummy_batch(self) -> None:
        self.driver_worker.execute_dummy_batch()

    def collective_rpc(
        self,
        method: RPCMethod,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Run `method` on every worker; their results in rank order (the driver's first).

        `method` is a `Worker` method's name or a function called as `method(worker, *args,
        **kwargs)` (under multiprocessing it must be importable by name: defined at module
        level). A worker that fails raises here with its rank and error; `timeout` (seconds)
        bounds the wait for the other ranks."""
        return self._run_everywhere(RPCCall(method, args, kwargs or {}, timeout))

    def _run_everywhere(self, call: RPCCall) -> list[Any]:
        """The call on every rank (here: the one worker)."""
        return [run_rpc(self.driver_worker, call.method, call.args, call.kwargs)]

    def shutdown(self) -> None:
        self.driver_worker.shutdown()


class UniProcExecutor(Executor):
    """One worker, in this process."""

    @classmethod
    def start(cls, s: StartUp) -> Executor:
        worker = Worker(s.config, s.device, TPDriver(None), s.kind_part)
        worker.start(s.on_runner, s.check_num_blocks)
        return cls(s.config, worker)


class MultiprocExecutor(Executor):
    """The driver's worker here, the other ranks in processes started with the engine."""

    # What starts the other ranks (`tp_launch.TPWorkers`: spawned processes).
    launcher: type[TPWorkers] = TPWorkers

    def __init__(self, config: EngineConfig, driver_worker: Worker) -> None:
        super().__init__(config, driver_worker)
        # Dropping the engine stops the workers too (they leave their loops with the driver).
        self._finalizer = weakref.finalize(self, _stop, driver_worker.tp, driver_worker.pipeline)

    @classmethod
    def start(cls, s: StartUp) -> Executor:
        config = s.config
        pipeline = None
        if config.parallel.pipeline_parallel_size > 1:
            stages = start_pipeline_parallel(config, run_pp_worker, cls.launcher)
            assert config.model is not None
            hidden_size = int(config.model.hf_config.hidden_size)
            pipeline = PipelineChannel(stages, config.model.dtype, hidden_size)
        try:
            tp = TPDriver(start_tensor_parallel(config, run_tp_worker, cls.launcher))
        except BaseException:
            if pipeline is not None:
                pipeline.abandon()
            raise
        worker = Worker(config, s.device, tp, s.kind_part, pipeline)
        try:
            worker.start(s.on_runner, s.check_num_blocks)
        except BaseException:
            # The other ranks fail the same way or wait for a collective that never comes:
            # do not leave them waiting.
            tp.abandon()
            if pipeline is not None:
                pipeline.abandon()
            raise
        return cls(config, worker)

    @property
    def is_collective(self) -> bool:
        return True

    def check_health(self) -> None:
        if not self._finalizer.alive:
            return  # shut down: its workers left on purpose
        self.driver_worker.tp.check_workers()
        if self.driver_worker.pipeline is not None:
            self.driver_worker.pipeline.check_stages()

    def _run_everywhere(self, call: RPCCall) -> list[Any]:
        """The driver broadcasts the call, runs it, and gathers every rank's reply (bounded)."""
        if self.driver_worker.pipeline is not None:
            raise NotImplementedError(
                "collective_rpc does not reach pipeline stages yet (pipeline_parallel_size > 1)"
            )
        tp = self.driver_worker.tp
        name = call.name
        tp.check_workers()
        tp.broadcast(("rpc", call.method, call.args, call.kwargs))
        mine: tuple[bool, Any]
        try:
            mine = (True, run_rpc(self.driver_worker, call.method, call.args, call.kwargs))
        except Exception as exc:  # collect the others' replies first: they were sent
            mine = (False, f"{type(exc).__name__}: {exc}")
        wait_s = ACTIVATION_TIMEOUT_S if call.timeout is None else call.timeout
        what = f"running {name!r} on every worker"
        try:
            replies = gather_replies(mine, get_tp_cpu_group(), tp.workers, what, wait_s)
        except WorkerLostError as exc:
            tp.abandon()  # a rank is gone or stuck in the middle of the call: no way back
            raise RuntimeError(
                f"collective_rpc({name!r}): {exc}; the engine cannot continue"
            ) from exc
        results = []
        for rank, (ok, value) in enumerate(replies):
            if not ok:
                raise RuntimeError(f"collective_rpc({name!r}) failed on rank {rank}: {value}")
            results.append(value)
        return results

    def shutdown(self) -> None:
        super().shutdown()
        self._finalizer()


class RayExecutor(MultiprocExecutor):
    """The driver's worker here, the other ranks as Ray actors (`ray_workers.py`)."""

    launcher = RayWorkers


def _stop(tp: TPDriver, pipeline: PipelineChannel | None) -> None:
    """Tell the other ranks to leave their loops and wait for their processes (once)."""
    tp.stop()  # stage 0's TP ranks (they pass the stop on to their next stage)
    if pipeline is not None:
        pipeline.stop()
