"""The graph wrapper's bookkeeping on CPU, with capture and replay faked (`EagerReplayCapturer`).

The fake has a real graph's memory semantics: replay recomputes from the buffers captured and
writes into the output tensors of the capture. So these tests see what a replayed CUDA graph
would: which key captured, which inputs a replay reads, and that outputs are static memory.
"""

from __future__ import annotations

import pytest
import torch

from tokenwise.compilation.cuda_graph import CUDAGraphWrapper, EagerReplayCapturer
from tokenwise.config import CUDAGraphMode, EngineConfig
from tokenwise.forward_context import BatchDescriptor, set_forward_context

M = CUDAGraphMode


class Recorder:
    """A runnable `x * w + n` that counts its calls; `w` plays a weight (static)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
        self.calls += 1
        return x * w + n


def make(mode: CUDAGraphMode = M.PIECEWISE, **kwargs):
    capturers: list[EagerReplayCapturer] = []

    def factory() -> EagerReplayCapturer:
        capturers.append(EagerReplayCapturer())
        return capturers[-1]

    fn = Recorder()
    wrapper = CUDAGraphWrapper(fn, mode, factory, static_args=[False, True, True], **kwargs)
    return wrapper, fn, capturers


def ctx(mode: CUDAGraphMode, tokens: int | None):
    desc = None if tokens is None else BatchDescriptor(tokens)
    return set_forward_context(
        None, EngineConfig(), cudagraph_runtime_mode=mode, batch_descriptor=desc
    )


def test_other_modes_and_no_context_call_through() -> None:
    wrapper, fn, capturers = make(M.PIECEWISE)
    x, w = torch.ones(4), torch.full((4,), 2.0)
    assert torch.equal(wrapper(x, w, 4), x * w + 4)  # no forward context
    with ctx(M.NONE, None):
        wrapper(x, w, 4)
    with ctx(M.FULL, 4):
        wrapper(x, w, 4)
    assert fn.calls == 3 and capturers == [] and wrapper.entries == {}


def test_capture_once_per_key_then_replay_fresh_inputs_into_static_outputs() -> None:
    wrapper, fn, capturers = make(M.PIECEWISE)
    w = torch.full((4,), 2.0)
    with ctx(M.PIECEWISE, 4):
        first = wrapper(torch.arange(4.0), w, 4)
    assert torch.equal(first, torch.arange(4.0) * 2 + 4)
    assert len(capturers) == 1 and fn.calls == 1
    with ctx(M.PIECEWISE, 4):
        second = wrapper(torch.ones(4), w, 4)
    assert second is first  # the graph's output memory, rewritten by the replay
    assert torch.equal(second, torch.full((4,), 6.0))
    assert capturers[0].num_replays == 1 and len(capturers) == 1
    with ctx(M.PIECEWISE, 8):
        wrapper(torch.ones(8), torch.ones(8), 8)
    assert len(capturers) == 2 and set(wrapper.entries) == {BatchDescriptor(4), BatchDescriptor(8)}


def test_static_args_are_read_in_place_and_others_are_copied() -> None:
    wrapper, _, _ = make(M.FULL)
    x, w = torch.ones(4), torch.full((4,), 2.0)
    with ctx(M.FULL, 4):
        wrapper(x, w, 4)
    entry = wrapper.entries[BatchDescriptor(4)]
    assert entry.inputs[1] is w  # captured by address
    assert entry.inputs[0] is not x  # copied into a buffer owned by the entry
    x.fill_(100.0)  # the caller reusing its own tensor does not leak into the graph
    w.fill_(3.0)  # a weight updated in place is seen by the next replay
    with ctx(M.FULL, 4):
        out = wrapper(torch.full((4,), 5.0), w, 4)
    assert torch.equal(out, torch.full((4,), 19.0))


def test_replay_rejects_inputs_that_do_not_fit_the_graph() -> None:
    wrapper, _, _ = make(M.PIECEWISE, check_static_addresses=True)
    w = torch.ones(4)
    with ctx(M.PIECEWISE, 4):
        wrapper(torch.ones(4), w, 4)
        with pytest.raises(RuntimeError, match="shape"):
            wrapper(torch.ones(3), w, 4)
        with pytest.raises(RuntimeError, match="padded"):
            wrapper(torch.ones(4), w, 3)
        with pytest.raises(RuntimeError, match="moved"):
            wrapper(torch.ones(4), w.clone(), 4)


def test_wrapper_mode_must_be_a_runtime_graph_mode() -> None:
    for mode in (M.NONE, M.FULL_AND_PIECEWISE):
        with pytest.raises(ValueError, match="PIECEWISE or FULL"):
            CUDAGraphWrapper(Recorder(), mode, EagerReplayCapturer)


def test_fake_capturer_replays_into_the_captured_tuple() -> None:
    source = [torch.ones(2)]
    capturer = EagerReplayCapturer()
    out = capturer.capture(lambda: (source[0] * 2, source[0] + 1))
    source[0] = torch.full((2,), 5.0)
    capturer.replay()
    assert torch.equal(out[0], torch.full((2,), 10.0)) and torch.equal(
        out[1], torch.full((2,), 6.0)
    )
