"""Where the Ray executor's ranks go: one placement-group bundle per rank, and the rendezvous.

A TP/PP engine of `size` ranks asks Ray for `size` bundles (`{"CPU": 1}`, plus `{"GPU": 1}` on
CUDA), with the strategy `ray_placement_strategy` names (Ray's: PACK, SPREAD, STRICT_PACK,
STRICT_SPREAD). Rank 0 is the driver: it runs in the engine's process, not in an actor, but
its bundle reserves its share of the node it runs on, so the other ranks' actors never
oversubscribe that node. Which bundle is rank 0's is decided after placement
(`rank_bundles`): one on the driver's node; a placement with none there is refused.

The ranks meet at a torch.distributed store the driver hosts (`distributed.rendezvous`). When
every bundle sits on the driver's host (one machine, or `ray.cluster_utils.Cluster`'s several
raylets on one machine, which share its address) they meet on loopback, as spawned processes
do. When some sit on other hosts the store must be reachable from them: it listens on the
driver's node address only (as Ray reports it), and only with `TOKENWISE_CLUSTER_SECRET` set,
the secret every rank proves it holds when it arrives (`rendezvous.arrival_proof`).
"""

from __future__ import annotations

from typing import Any

from tokenwise import envs
from tokenwise.config import EngineConfig
from tokenwise.distributed.rendezvous import SECRET_ENV
from tokenwise.distributed.tp_state import free_port
from tokenwise.kv_cache.events_config import is_loopback

# How long the placement group may take to be placed (resources of a busy cluster).
PLACEMENT_TIMEOUT_S = 60.0


def rank_bundle(config: EngineConfig) -> dict[str, float]:
    """What one rank reserves."""
    bundle = {"CPU": 1.0}
    if str(config.device).startswith("cuda"):
        bundle["GPU"] = 1.0
    return bundle


def place(ray: Any, config: EngineConfig, size: int) -> tuple[Any, dict[int, str]]:
    """A ready placement group of `size` bundles and each bundle's node id; a group Ray
    cannot place within the bound is removed and refused with the strategy and the need."""
    from ray.util import placement_group_table
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = rank_bundle(config)
    strategy = config.parallel.ray_placement_strategy
    group = placement_group([dict(bundle) for _ in range(size)], strategy=strategy)
    if not group.wait(timeout_seconds=PLACEMENT_TIMEOUT_S):
        remove_placement_group(group)
        raise RuntimeError(
            f"the Ray cluster could not place {size} tensor/pipeline-parallel rank(s) of "
            f"{bundle} each with ray_placement_strategy={strategy} within "
            f"{PLACEMENT_TIMEOUT_S:g} s; add nodes, free resources, choose another strategy "
            "or lower the parallelism"
        )
    nodes = placement_group_table(group).get("bundles_to_node_id", {})
    return group, {int(index): node for index, node in nodes.items()}


def rank_bundles(here: str, nodes: dict[int, str]) -> list[int]:
    """The bundle index of each rank: rank 0's on the driver's node `here`, the others in
    bundle order (Ray orders a group's bundles node by node)."""
    local = [index for index, node in sorted(nodes.items()) if node == here]
    if not local:
        raise RuntimeError(
            "Ray placed no tensor/pipeline-parallel rank's bundle on the engine's node, where "
            "rank 0 runs; give this node a free CPU (GPU) or use ray_placement_strategy=PACK"
        )
    return [local[0]] + [index for index in sorted(nodes) if index != local[0]]


def rendezvous_host(ray: Any, here: str, nodes: dict[int, str]) -> str | None:
    """Where the ranks must meet: None when every bundle is on the driver's host (loopback
    will do), else the driver node's address, which needs the cluster secret."""
    address = {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes()}
    mine = address.get(here, "")
    remote = sorted({address.get(n, n) for n in nodes.values() if address.get(n) != mine})
    if not remote:
        return None
    if not envs.get(SECRET_ENV):
        raise RuntimeError(
            f"Ray placed tensor/pipeline-parallel ranks on other hosts ({', '.join(remote)}), "
            f"which meet this one at a rendezvous on {mine}: that needs {SECRET_ENV} set to "
            "the same value for every rank (docs/cluster.md), or a placement on one host "
            "(ray_placement_strategy=STRICT_PACK)"
        )
    return mine


def move_rendezvous(init_method: str, host: str | None, config: EngineConfig) -> str:
    """`init_method` moved to `host` (a fresh port there), unless no move is needed or the
    world meets at the data-parallel address, which the user chose (refused on loopback: the
    ranks on other hosts could not reach it)."""
    parallel = config.parallel
    if host is None:
        return init_method
    if parallel.data_parallel_size > 1:
        if is_loopback(parallel.data_parallel_master_ip):
            raise RuntimeError(
                "Ray placed tensor-parallel ranks on other hosts, which cannot reach this data-"
                f"parallel rank's rendezvous on {parallel.data_parallel_master_ip}: set "
                "data_parallel_address to an address of this host they can reach"
            )
        return init_method
    return f"tcp://{host}:{free_port(host)}"
