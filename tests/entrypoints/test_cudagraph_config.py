"""CUDA-graph settings from the user: CLI flags, defaults per device, and refused combinations."""

from __future__ import annotations

import argparse

import pytest
import torch

from tokenwise.attention.backends import selector
from tokenwise.attention.backends.torch_backend import TorchAttentionBackend
from tokenwise.attention.backends.triton_backend import TritonAttentionBackend
from tokenwise.compilation.cpu_graph import CPUGraphCapturer
from tokenwise.config import CompilationConfig, CUDAGraphMode, EngineConfig
from tokenwise.entrypoints.engine_args import (
    add_engine_args,
    engine_kwargs,
    parse_capture_sizes,
    parse_cudagraph_mode,
)
from tokenwise.entrypoints.llm import resolve_cudagraph_mode
from tokenwise.runner.graph_setup import check_cudagraph_config, new_capturer_factory

M = CUDAGraphMode


def test_cli_flags() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--cudagraph-mode", "full_and_piecewise", "--cudagraph-capture-sizes", "8, 1,4,4"]
    )
    kwargs = engine_kwargs(args)
    assert kwargs["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert kwargs["cudagraph_capture_sizes"] == [1, 4, 8]
    defaults = engine_kwargs(parser.parse_args([]))
    assert defaults["cudagraph_mode"] is None and defaults["cudagraph_capture_sizes"] is None


@pytest.mark.parametrize("text", ["0,1", "1,a", "", "-4"])
def test_bad_capture_sizes_are_rejected(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="integers >= 1"):
        parse_capture_sizes(text)


def test_bad_mode_lists_the_valid_ones() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="NONE, PIECEWISE, FULL, FULL_DECODE_ONLY"):
        parse_cudagraph_mode("fullgraph")


def test_default_mode_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_cudagraph_mode(None, "cpu", enforce_eager=False) is M.NONE
    assert resolve_cudagraph_mode(None, "cuda", enforce_eager=True) is M.NONE
    monkeypatch.setenv(selector.ENV_VAR, "triton")
    assert resolve_cudagraph_mode(None, "cuda", enforce_eager=False) is M.FULL_AND_PIECEWISE
    # Without a graph-safe decode only the pieces between attention calls are captured.
    monkeypatch.setenv(selector.ENV_VAR, "torch")
    assert resolve_cudagraph_mode(None, "cuda:0", enforce_eager=False) is M.PIECEWISE
    assert resolve_cudagraph_mode("full_decode_only", "cuda", False) is M.FULL_DECODE_ONLY
    assert resolve_cudagraph_mode("none", "cpu", True) is M.NONE
    # CPU graphs (recorded C kernels) where eagerness was not asked for and the kind allows.
    assert resolve_cudagraph_mode(None, "cpu", True, cpu_graphs=True) is M.FULL_DECODE_ONLY
    assert resolve_cudagraph_mode("full", "cpu", True, cpu_graphs=True) is M.FULL


def test_moe_models_whose_experts_read_the_host_get_piecewise_graphs_at_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(selector.ENV_VAR, "triton")  # a backend whose decode could be captured
    assert resolve_cudagraph_mode(None, "cuda", False, moe_needs_host=True) is M.PIECEWISE
    assert resolve_cudagraph_mode("piecewise", "cuda", False, moe_needs_host=True) is M.PIECEWISE
    for full in ("full", "full_decode_only", "full_and_piecewise"):
        with pytest.raises(ValueError, match="MoE model.*cudagraph_mode=PIECEWISE"):
            resolve_cudagraph_mode(full, "cuda", False, moe_needs_host=True)
    # With a grouped matmul (no host read) an MoE model is graphed like a dense one.
    default = resolve_cudagraph_mode(None, "cuda", False, moe_needs_host=False)
    assert default is M.FULL_AND_PIECEWISE
    # Piecewise graphs are cut at the expert op, as at attention.
    assert "tokenwise::moe_experts" in CompilationConfig().splitting_ops


def test_which_devices_and_dtypes_have_a_grouped_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenwise.layers.fused_moe.experts import grouped_mm_available

    assert grouped_mm_available("cpu", torch.float32)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, dtype, expected in [
        ((9, 0), torch.bfloat16, True),
        ((9, 0), torch.float32, False),  # fp32 / fp16 experts loop on the host
        ((8, 0), torch.bfloat16, False),  # no grouped kernel before Hopper
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=capability: c)
        assert grouped_mm_available("cuda", dtype) is expected
    # Row strides must be 16-byte multiples: an expert intermediate size of 36 bf16 is not.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (9, 0))
    assert grouped_mm_available("cuda", torch.bfloat16, (2048, 768))
    assert not grouped_mm_available("cuda", torch.bfloat16, (2048, 36))


def test_refused_combinations() -> None:
    with pytest.raises(ValueError, match="PIECEWISE replays compiled pieces.*CUDA device"):
        resolve_cudagraph_mode("piecewise", "cpu", enforce_eager=True, cpu_graphs=True)
    with pytest.raises(ValueError, match="cannot be combined with enforce_eager"):
        resolve_cudagraph_mode("full_decode_only", "cpu", enforce_eager=True)
    with pytest.raises(ValueError, match="enforce_eager"):
        resolve_cudagraph_mode("piecewise", "cuda", enforce_eager=True)
    with pytest.raises(ValueError, match="need a CUDA device or the CPU"):
        new_capturer_factory(torch.device("meta"))
    assert isinstance(new_capturer_factory(torch.device("cpu"))(), CPUGraphCapturer)
    full = EngineConfig(
        compilation=CompilationConfig(cudagraph_mode=M.FULL_AND_PIECEWISE, use_compile=True),
        device="cuda",
    )
    check_cudagraph_config(full, TritonAttentionBackend)
    with pytest.raises(ValueError, match="'torch' attention backend.*cudagraph_mode=PIECEWISE"):
        check_cudagraph_config(full, TorchAttentionBackend)
    piecewise = EngineConfig(compilation=CompilationConfig(cudagraph_mode=M.PIECEWISE))
    with pytest.raises(ValueError, match="use_compile=True"):
        check_cudagraph_config(piecewise, TorchAttentionBackend)
    # Whole-model graphs of an eager model need no compilation.
    check_cudagraph_config(
        EngineConfig(compilation=CompilationConfig(cudagraph_mode=M.FULL_DECODE_ONLY)),
        TritonAttentionBackend,
    )
