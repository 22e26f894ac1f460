"""Suite-wide settings.

Every model in the suite is tiny, so torch's intra-op threads only add synchronisation: one
thread is faster, and it keeps timings sane on a CI machine whose other core is busy (with 2
threads and a busy core, small matmuls were measured ~10x slower).

Triton (installed with xgrammar) reads `TRITON_INTERPRET` when it is first imported, and any
module may import it first; without a GPU its kernels can only run interpreted, so the switch
is set here, before every test module.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def two_ray_nodes() -> Iterator[Any]:
    """A two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: two raylets of one
    CPU each, playing two hosts), this process its driver. Module-scoped: a start costs ~10 s,
    so a module's tests share one; each Ray module gets its own, since other modules start
    their own Ray. Torn down with every actor and placement group in it."""
    ray = pytest.importorskip("ray", reason="Ray tests need ray (.[ray])")
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
