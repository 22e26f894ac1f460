"""The Ray executor's workers: ranks 1..N-1 of an engine as Ray actors in a placement group.

`distributed_executor_backend="ray"` (`--distributed-executor-backend ray`, vLLM's names)
starts the other tensor- and pipeline-parallel ranks as Ray actors instead of spawned
processes. Each actor runs the same entry point a spawned process runs
(`worker_main.run_tp_worker` / `run_pp_worker`), so everything after the start is the
multiprocess executor's: the ranks join torch.distributed groups (gloo on CPU, NCCL on GPU),
run the one start-up sequence and serve the driver's step messages.

Placement: one bundle per rank (`{"CPU": 1}`, plus `{"GPU": 1}` on CUDA) in a placement group,
packed (`STRICT_PACK`) on the driver's node, which the driver waits for with a bound and a clear
error when the cluster has no room. The ranks rendezvous on loopback, so they must share the
driver's node: nothing listens beyond loopback without a secret, and torch.distributed's
rendezvous has none (ranks on other hosts wait for an authenticated rendezvous).

The cluster: `RAY_ADDRESS` (or an earlier `ray.init`) names one to join; otherwise Ray starts a
local one. The actors get the driver's `TOKENWISE_*` variables and `PYTHONPATH`
(`runtime_env`), so plugins and settings reach them as they reach spawned processes.

`RayWorkers` has `TPWorkers`' face: each actor's handle looks like a `multiprocessing.Process`
(`pid`, `exitcode`, `is_alive`, `join`, `kill`), where an actor "exits" when its entry point's
remote call finishes (normally: 0; raising or dying: 1), so the executor's liveness checks,
bounded waits and error messages work unchanged. A dropped or shut-down engine kills its actors
and removes its placement group.
"""

from __future__ import annotations

import os
import time
from typing import Any

from tokenwise import envs
from tokenwise.config import EngineConfig
from tokenwise.distributed.tp_launch import TPWorkers, WorkerMain

# How long the placement group may take to be placed (resources of a busy cluster).
PLACEMENT_TIMEOUT_S = 60.0


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "distributed_executor_backend='ray' needs Ray: pip install 'tokenwise[ray]'"
        ) from exc
    return ray


class _RankActor:
    """A Ray actor that runs one rank's entry point (made a remote class in `_start`)."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, worker_main: WorkerMain, config: EngineConfig, rank: int, init: str) -> int:
        worker_main(config, rank, init)
        return 0


class ActorProcess:
    """One rank's actor, with the face of a `multiprocessing.Process`."""

    def __init__(self, ray: Any, actor: Any, done: Any, pid: int) -> None:
        self._ray, self._actor, self._done, self.pid = ray, actor, done, pid
        self._exitcode: int | None = None

    @property
    def exitcode(self) -> int | None:
        if self._exitcode is None and not self._ray.is_initialized():
            self._exitcode = 1  # the Ray session ended: its actors are gone with it
        if self._exitcode is None:
            ready, _ = self._ray.wait([self._done], timeout=0)
            if ready:
                try:
                    self._ray.get(ready[0])
                    self._exitcode = 0
                except Exception:  # the entry point raised, or the actor died
                    self._exitcode = 1
        return self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        if self._ray.is_initialized():
            self._ray.wait([self._done], timeout=timeout)

    def kill(self) -> None:
        if not self._ray.is_initialized():
            return
        try:
            self._ray.kill(self._actor, no_restart=True)
        except Exception:  # already gone
            pass


class RayWorkers(TPWorkers):
    """`TPWorkers` whose ranks are Ray actors (see the module docstring)."""

    def _start(
        self, config: EngineConfig, init_method: str, worker_main: WorkerMain, size: int
    ) -> list[Any]:
        ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
        bundle = {"CPU": 1.0}
        if str(config.device).startswith("cuda"):
            bundle["GPU"] = 1.0
        group = placement_group([dict(bundle) for _ in range(1, size)], strategy="STRICT_PACK")
        self._placement = group
        self._remove = remove_placement_group
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(group)
            raise RuntimeError(
                f"the Ray cluster could not place {size - 1} worker(s) of {bundle} each on one "
                f"node within {PLACEMENT_TIMEOUT_S:g} s; free resources or lower the parallelism"
            )
        self._check_same_node(ray, group)
        env = envs.tokenwise_variables()
        if (path := envs.external("PYTHONPATH")) is not None:
            env["PYTHONPATH"] = path
        remote = ray.remote(_RankActor)
        procs = []
        for index, rank in enumerate(range(1, size)):
            actor = remote.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                name=None,
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=index
                ),
            ).remote()
            pid = ray.get(actor.pid.remote(), timeout=PLACEMENT_TIMEOUT_S)
            done = actor.run.remote(worker_main, config, rank, init_method)
            procs.append(ActorProcess(ray, actor, done, pid))
        return procs

    def _check_same_node(self, ray: Any, group: Any) -> None:
        """Refuse a placement off the driver's node (the rendezvous is on loopback)."""
        from ray.util import placement_group_table

        here = ray.get_runtime_context().get_node_id()
        nodes = set(placement_group_table(group).get("bundles_to_node_id", {}).values())
        if nodes - {here}:
            self._remove(group)
            raise RuntimeError(
                "Ray placed tensor/pipeline-parallel workers on another node; ranks on other "
                "hosts are not supported yet (their rendezvous listens on loopback only): run "
                "the engine on a node with room for every rank"
            )

    def join(self) -> None:
        """Wait for the actors to leave (bounded), kill what is left, free the placement."""
        super().join()
        for proc in self.procs:
            proc.kill()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(p.is_alive() for p in self.procs):
            time.sleep(0.05)
        if not _ray().is_initialized():
            return  # the session ended: its placement groups went with it
        try:
            self._remove(self._placement)
        except Exception:  # the cluster went away first
            pass
