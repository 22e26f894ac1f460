"""Suite-wide settings.

Every model in the suite is tiny, so torch's intra-op threads only add synchronisation: one
thread is faster, and it keeps timings sane on a CI machine whose other core is busy (with 2
threads and a busy core, small matmuls were measured ~10x slower).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
