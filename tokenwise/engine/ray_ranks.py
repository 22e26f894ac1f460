"""`data_parallel_backend="ray"`: every data-parallel rank's engine core as a Ray actor.

Without Ray, DP across hosts means starting `tokenwise serve --headless` by hand on each host.
With `--data-parallel-backend ray` (vLLM's name) the front end asks Ray for one bundle per rank
in a placement group, packed onto as few nodes as have room (`PACK`: spread over nodes when one
has no room), and starts in each bundle an actor that runs exactly what a headless rank runs
(`remote_core.run_remote_engine_core`): it dials the front end's RPC port, says hello, is
welcomed and serves. So everything after the start is the headless protocol, authentication
included: beyond loopback the front end refuses to listen without `TOKENWISE_CLUSTER_SECRET`,
and the actors get the driver's `TOKENWISE_*` variables (the secret among them) through Ray's
`runtime_env`.

Rank 0 hosts the DP rendezvous (a torch.distributed store at `data_parallel_master_ip`, the
front end's address), so it is given a bundle on the front end's node; a placement with no
bundle there is refused, as is a front end on loopback whose ranks Ray put on a node that is
another host (it could not dial back). Each actor's handle has the face of a
`multiprocessing.Process` (`executor.ray_workers.ActorProcess`), so the client's liveness
checks and error messages treat a dead actor as a dead local core ("data-parallel rank 1 (pid
N) exited"). `RayCores.release` (called when the client stops its cores) kills every actor and
removes the placement group.
"""

from __future__ import annotations

import os
from typing import Any

from tokenwise import envs
from tokenwise.config import EngineConfig
from tokenwise.engine.remote_core import run_remote_engine_core
from tokenwise.engine.remote_ranks import engine_ready_timeout_s
from tokenwise.executor.ray_workers import PLACEMENT_TIMEOUT_S, ActorProcess, _ray
from tokenwise.kv_cache.events_config import is_loopback


class _CoreActor:
    """A Ray actor that runs one rank's engine core (made a remote class in `start`)."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, config: EngineConfig, rank: int, ready_timeout_s: float) -> int:
        run_remote_engine_core(config, rank, ready_timeout_s)
        return 0


class RayCores(list):
    """The ranks' `ActorProcess`es, in rank order, owning their placement group."""

    def __init__(self, procs: list[ActorProcess], ray: Any, group: Any) -> None:
        super().__init__(procs)
        self._ray, self._group = ray, group

    def release(self) -> None:
        """Kill every actor and remove the placement group (idempotent)."""
        for proc in self:
            proc.kill()
        if self._group is None or not self._ray.is_initialized():
            return  # the Ray session ended: its actors and groups went with it
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self._group)
        except Exception:  # noqa: BLE001 - the cluster went away first
            pass
        self._group = None


def check_ray_layout(config: EngineConfig) -> None:
    """What Ray DP does not support yet, refused before anything starts."""
    if config.lora is not None:
        raise ValueError(
            "enable_lora is not supported with data_parallel_backend='ray' yet (adapters are "
            "checked by rank 0 over a local socket); use data_parallel_backend='mp'"
        )


def start_ray_cores(config: EngineConfig) -> RayCores:
    """One actor per DP rank, placed and started; they connect to the front end by themselves
    (`check_ray_layout` ran before the client bound its sockets)."""
    ray = _ray()
    from ray.util import placement_group_table
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
    parallel = config.parallel
    size = parallel.data_parallel_size
    bundle = {"CPU": 1.0}
    if str(config.device).startswith("cuda"):
        bundle["GPU"] = 1.0
    group = placement_group([dict(bundle) for _ in range(size)], strategy="PACK")
    try:
        if not group.wait(timeout_seconds=PLACEMENT_TIMEOUT_S):
            raise RuntimeError(
                f"the Ray cluster could not place {size} data-parallel rank(s) of {bundle} "
                f"each within {PLACEMENT_TIMEOUT_S:g} s; add nodes or lower data_parallel_size"
            )
        nodes = placement_group_table(group).get("bundles_to_node_id", {})
        order = _rank_order(ray, nodes, parallel.data_parallel_master_ip)
        procs = _start_actors(ray, config, group, order, bundle, PlacementGroupSchedulingStrategy)
    except BaseException:
        remove_placement_group(group)
        raise
    return RayCores(procs, ray, group)


def _rank_order(ray: Any, nodes: dict[int, str], master_ip: str) -> list[int]:
    """Bundle index per rank: rank 0 on the front end's node, the others as placed."""
    here = ray.get_runtime_context().get_node_id()
    local = [index for index, node in sorted(nodes.items()) if node == here]
    if not local:
        raise RuntimeError(
            "Ray placed no data-parallel rank on the front end's node, where rank 0 must run "
            "(it hosts the ranks' rendezvous); give this node at least one free CPU"
        )
    if is_loopback(master_ip):
        # A node at the front end's node's address is this host (a test's `Cluster`, several
        # raylets on one machine): its ranks reach loopback; any other is another host.
        address = {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes()}
        remote = sorted({n for n in nodes.values() if address.get(n) != address.get(here)})
        if remote:
            raise RuntimeError(
                f"Ray placed data-parallel ranks on other hosts "
                f"({', '.join(address.get(n, n) for n in remote)}), which cannot reach a front "
                f"end on {master_ip}: set data_parallel_address to an address of this host they "
                "can reach, and TOKENWISE_CLUSTER_SECRET (see docs/cluster.md)"
            )
    return [local[0]] + [index for index in sorted(nodes) if index != local[0]]


def _start_actors(
    ray: Any,
    config: EngineConfig,
    group: Any,
    order: list[int],
    bundle: dict[str, float],
    strategy: Any,
) -> list[ActorProcess]:
    env = envs.tokenwise_variables()
    if (path := envs.external("PYTHONPATH")) is not None:
        env["PYTHONPATH"] = path
    # One CPU per bundle: torch in the actor uses that many threads, not every core it sees.
    env["OMP_NUM_THREADS"] = envs.external("OMP_NUM_THREADS") or str(int(bundle["CPU"]))
    timeout = engine_ready_timeout_s()
    remote = ray.remote(_CoreActor)
    actors = [
        remote.options(
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            runtime_env={"env_vars": env},
            scheduling_strategy=strategy(placement_group=group, placement_group_bundle_index=index),
        ).remote()
        for index in order
    ]
    procs: list[ActorProcess] = []
    try:
        pids = ray.get([actor.pid.remote() for actor in actors], timeout=timeout)
        for rank, (actor, pid) in enumerate(zip(actors, pids, strict=True)):
            done = actor.run.remote(config, rank, timeout)
            procs.append(ActorProcess(ray, actor, done, pid))
    except BaseException:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        raise
    return procs
