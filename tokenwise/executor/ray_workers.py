"""The Ray executor's workers: ranks 1..N-1 of an engine as Ray actors in a placement group.

`distributed_executor_backend="ray"` (`--distributed-executor-backend ray`, vLLM's names)
starts the other tensor- and pipeline-parallel ranks as Ray actors instead of spawned
processes. Each actor runs the same entry point a spawned process runs
(`worker_main.run_tp_worker` / `run_pp_worker`), so everything after the start is the
multiprocess executor's: the ranks join torch.distributed groups (gloo on CPU, NCCL on GPU),
run the one start-up sequence and serve the driver's step messages, over TP, PP or both.

Placement (`ray_placement.py`): one bundle per rank, the driver's included, with the
`ray_placement_strategy` setting's strategy, so the actors may run on other nodes; the ranks
meet on loopback when every bundle is on the driver's host, else at the driver node's address
with the cluster secret.

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
from tokenwise.executor.ray_placement import (
    PLACEMENT_TIMEOUT_S,
    move_rendezvous,
    place,
    rank_bundle,
    rank_bundles,
    rendezvous_host,
)


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

    def where(self) -> tuple[int, str]:
        """This actor's pid and Ray node id."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def run(self, worker_main: WorkerMain, config: EngineConfig, rank: int, init: str) -> int:
        worker_main(config, rank, init)
        return 0


class ActorProcess:
    """One rank's actor, with the face of a `multiprocessing.Process`."""

    def __init__(self, ray: Any, actor: Any, done: Any, pid: int, node_id: str = "") -> None:
        self._ray, self._actor, self._done, self.pid = ray, actor, done, pid
        self.node_id = node_id  # the Ray node it runs on
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
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
        self._remove = remove_placement_group
        group, nodes = place(ray, config, size)
        self._placement = group
        try:
            here = ray.get_runtime_context().get_node_id()
            order = rank_bundles(here, nodes)
            self.init_method = move_rendezvous(
                init_method, rendezvous_host(ray, here, nodes), config
            )
            return self._start_actors(ray, config, worker_main, group, order[1:])
        except BaseException:
            remove_placement_group(group)
            raise

    def _start_actors(
        self,
        ray: Any,
        config: EngineConfig,
        worker_main: WorkerMain,
        group: Any,
        bundles: list[int],
    ) -> list[ActorProcess]:
        """Ranks 1.. in `bundles` (in rank order), each running its entry point."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = rank_bundle(config)
        env = envs.tokenwise_variables()
        if (path := envs.external("PYTHONPATH")) is not None:
            env["PYTHONPATH"] = path
        # One CPU per bundle: torch in the actor uses that many threads, not every core.
        env["OMP_NUM_THREADS"] = envs.external("OMP_NUM_THREADS") or str(int(bundle["CPU"]))
        remote = ray.remote(_RankActor)
        actors = [
            remote.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=index
                ),
            ).remote()
            for index in bundles
        ]
        procs = []
        try:
            places = ray.get([a.where.remote() for a in actors], timeout=PLACEMENT_TIMEOUT_S)
            for rank, (actor, (pid, node)) in enumerate(zip(actors, places, strict=True), 1):
                done = actor.run.remote(worker_main, config, rank, self.init_method)
                procs.append(ActorProcess(ray, actor, done, pid, node))
        except BaseException:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            raise
        return procs

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
