"""The gated delta rule: the chunked prefill form and the C decode kernel against the per-token
definition (`delta_rule_step`, itself checked against the rule written out by hand)."""

from __future__ import annotations

import pytest
import torch

from tokenwise.models.gated_delta_rule import (
    chunked_gated_delta_rule,
    delta_rule_step,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from tokenwise.native import gdn_decode

needs_kernel = pytest.mark.skipif(gdn_decode.load() is None, reason="no C compiler here")


def _inputs(t: int, heads: int, dk: int, dv: int, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(t, heads, dk, generator=gen)) * dk**-0.5
    k = l2_normalize(torch.randn(t, heads, dk, generator=gen))
    v = torch.randn(t, heads, dv, generator=gen)
    g = -torch.rand(t, heads, generator=gen) * 3  # strong and weak decays
    beta = torch.rand(t, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def test_step_is_the_delta_rule() -> None:
    q, k, v, g, beta, state = _inputs(1, 2, 4, 3)
    out, new = delta_rule_step(state, q[0], k[0], v[0], g[0], beta[0])
    for h in range(2):
        s = state[h] * torch.exp(g[0, h])
        s = s + beta[0, h] * torch.outer(k[0, h], v[0, h] - s.T @ k[0, h])
        torch.testing.assert_close(new[h], s)
        torch.testing.assert_close(out[h], s.T @ q[0, h])


@pytest.mark.parametrize("length", [1, 63, 64, 150])
def test_chunked_form_equals_the_recurrent_form(length: int) -> None:
    q, k, v, g, beta, state = _inputs(length, 3, 16, 8)
    kept = torch.empty(length, 3 * 16 * 8)
    want_out, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, state, kept)
    out, final = chunked_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kept[-1], want_state.flatten())
    # Split in two steps, the second continuing from the first's state: the same outputs.
    cut = length // 2
    if cut:
        first, mid = chunked_gated_delta_rule(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], state)
        second, end = chunked_gated_delta_rule(q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], mid)
        torch.testing.assert_close(torch.cat([first, second]), want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(end, want_state, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dv", [16, 20])  # 20: a vector tail on AVX2 and AVX-512
def test_decode_kernel_updates_its_slots_in_place(dv: int, dtype: torch.dtype) -> None:
    """Against the torch step on the same state: a bf16 cache is widened, stepped in float32
    and rounded back (to nearest even, as torch's `.to(torch.bfloat16)`)."""
    n, nk, nv, dk, offset = 3, 2, 4, 16, 12
    gen = torch.Generator().manual_seed(1)
    states = torch.randn(6, offset + nv * dk * dv, generator=gen).to(dtype)
    before = states.clone()
    slots = torch.tensor([4, 0, 2])
    q, k, _, _, _, _ = _inputs(n, nk, dk, dv, seed=2)
    _, _, v, g, beta, _ = _inputs(n, nv, dk, dv, seed=3)
    out = gdn_decode.gated_delta_decode(states, offset, slots, q, k, v, g, beta)
    assert out is not None and out.dtype == torch.float32
    # Value head h reads key head h // (nv / nk).
    qv, kv = q.repeat_interleave(nv // nk, dim=1), k.repeat_interleave(nv // nk, dim=1)
    old = before[slots, offset:].view(n, nv, dk, dv).float()
    want_out, want_state = delta_rule_step(old, qv, kv, v, g, beta)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    got_state = states[slots, offset:].view(n, nv, dk, dv)
    if dtype == torch.float32:
        torch.testing.assert_close(got_state, want_state)
    else:  # at most one bf16 step apart where float32 rounding differs at a midpoint
        assert got_state.dtype == torch.bfloat16
        torch.testing.assert_close(
            got_state.float(), want_state.to(dtype).float(), atol=1e-6, rtol=8e-3
        )
        assert (got_state == want_state.to(dtype)).float().mean() > 0.99
    untouched = [1, 3, 5]
    assert torch.equal(states[untouched], before[untouched])
    assert torch.equal(states[:, :offset], before[:, :offset])  # the conv state before it


@needs_kernel
def test_decode_kernel_refuses_bad_slots_and_declines_other_dtypes() -> None:
    states = torch.zeros(2, 4 * 4)
    q = k = torch.zeros(1, 1, 4)
    v, g, beta = torch.zeros(1, 1, 4), torch.zeros(1, 1), torch.zeros(1, 1)
    with pytest.raises(ValueError, match=r"state slots must lie in \[0, 2\)"):
        gdn_decode.gated_delta_decode(states, 0, torch.tensor([2]), q, k, v, g, beta)
    with pytest.raises(ValueError, match="does not fit a state row of 16"):
        gdn_decode.gated_delta_decode(states, 4, torch.tensor([0]), q, k, v, g, beta)
    halves = states.to(torch.float16)
    assert gdn_decode.gated_delta_decode(halves, 0, torch.tensor([0]), q, k, v, g, beta) is None
