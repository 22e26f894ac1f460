"""Weights moved onto transparent huge pages: same values, aliasing kept, the memory advised."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenwise.layers import huge_pages
from tokenwise.layers.quantization.weight_only import QuantizedWeight, quantize
from tokenwise.platform import HUGE_PAGE, huge_page_buffer

BIG = (1024, 1024)  # 4 MB in float32: above the 2 MB minimum


def _advised(tensor: torch.Tensor) -> bool:
    """Whether the mapping holding `tensor` carries madvise(MADV_HUGEPAGE) ("hg" in smaps)."""
    addr = tensor.data_ptr()
    lines = open("/proc/self/smaps").read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()
    return False


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(*BIG)
        self.head = nn.Linear(BIG[1], BIG[0], bias=False)
        self.head.weight = self.embed.weight  # tied, as small LMs are
        self.small = nn.Linear(8, 8)
        fused = torch.randn(2 * BIG[0], BIG[1])
        self.register_buffer("part", fused[: BIG[0]])  # a view of a bigger storage
        self.packed_weight = quantize(torch.randn(2048, 2048), 4, 32, True)


@pytest.fixture
def model() -> Tied:
    if huge_page_buffer(HUGE_PAGE) is None:
        pytest.skip("this platform gives no huge-page memory (no mmap/madvise)")
    torch.manual_seed(0)
    return Tied()


def test_large_weights_move_with_their_values_and_ties(model: Tied) -> None:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q_before = model.packed_weight.qweight.clone()
    old_embed, old_part = model.embed.weight.data_ptr(), model.part.data_ptr()
    moved = huge_pages.move_weights_to_huge_pages(model)

    weight = model.embed.weight
    assert weight.data_ptr() != old_embed and _advised(weight)
    assert model.head.weight is weight  # still one tensor for both
    assert model.part.data_ptr() == old_part  # a view: left where it is
    assert not _advised(model.small.weight)  # too small to be worth a 2 MB page
    qw: QuantizedWeight = model.packed_weight
    assert _advised(qw.qweight) and torch.equal(qw.qweight, q_before)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    embed_bytes = weight.numel() * weight.element_size()
    assert moved == embed_bytes + qw.qweight.numel()  # 2 MB of int4; its 256 KB scales stay
    # Moved weights still compute.
    x = torch.randint(0, BIG[0], (3,))
    torch.testing.assert_close(model.head(model.embed(x)), model.embed(x) @ weight.T)


def test_switched_off_moves_nothing(model: Tied, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENWISE_CPU_HUGE_PAGES", "0")
    ptr = model.embed.weight.data_ptr()
    assert huge_pages.move_weights_to_huge_pages(model) == 0
    assert model.embed.weight.data_ptr() == ptr


def test_buffer_starts_on_a_huge_page_boundary_and_is_zeroed() -> None:
    buf = huge_page_buffer(3 * HUGE_PAGE + 5)
    if buf is None:
        pytest.skip("no huge-page memory here")
    assert buf.data_ptr() % HUGE_PAGE == 0
    assert buf.numel() == 3 * HUGE_PAGE + 5 and int(buf.count_nonzero()) == 0
    assert _advised(buf)
