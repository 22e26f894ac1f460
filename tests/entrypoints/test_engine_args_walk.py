"""Every `EngineArgs` setting, walked: the CLI commands, the server and `LLM(...)` accept it
under the same name and with the same default, and a value given on a command line reaches
the same field as the keyword. Adding a setting without a sample value here fails the test,
so each new flag is parsed at least once."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from typing import Any

import pytest

from tokenwise.config import PoolerConfig, SpeculativeConfig
from tokenwise.entrypoints import llm as llm_module
from tokenwise.entrypoints.cli import build_parser
from tokenwise.entrypoints.engine_args import EngineArgs, build_engine_config
from tokenwise.entrypoints.engine_flags import SERVE_ONLY, cli_default, option_strings
from tokenwise.kv_cache.events_config import KVEventsConfig

COMMANDS = ("generate", "chat", "serve")
SETTINGS = [f for f in fields(EngineArgs) if not f.metadata["alias_of"]]

# Command-line text -> the value `LLM(...)` takes, for every setting with a value to parse.
SAMPLES: dict[str, tuple[str, Any]] = {
    "model": ("/ckpt", "/ckpt"),
    "tokenizer": ("tok-dir", "tok-dir"),
    "limit_mm_per_prompt": ('{"image": 2}', {"image": 2}),
    "max_num_encoder_input_tokens": ("64", 64),
    "override_pooler_config": ('{"pooling_type": "mean"}', PoolerConfig("MEAN")),
    "max_model_len": ("77", 77),
    "distributed_executor_backend": ("ray", "ray"),
    "kv_events_config": ('{"enable_kv_cache_events": true}', KVEventsConfig(True)),
    "max_num_seqs": ("3", 3),
    "max_num_batched_tokens": ("99", 99),
    "block_size": ("32", 32),
    "kv_cache_memory": ("1MiB", 1 << 20),
    "num_gpu_blocks": ("64", 64),
    "kv_offloading_size": ("2.5", 2.5),
    "kv_offloading_dir": ("/tmp/kv-tier", "/tmp/kv-tier"),
    "gpu_memory_utilization": ("0.5", 0.5),
    "cudagraph_mode": ("full", "FULL"),
    "cudagraph_capture_sizes": ("4,1", [1, 4]),
    "seed": ("7", 7),
    "speculative_config": (
        '{"method": "ngram", "num_speculative_tokens": 2}',
        SpeculativeConfig(num_speculative_tokens=2, method="ngram"),
    ),
    "tensor_parallel_size": ("2", 2),
    "pipeline_parallel_size": ("2", 2),
    "data_parallel_size": ("4", 4),
    "data_parallel_size_local": ("2", 2),
    "data_parallel_start_rank": ("2", 2),
    "data_parallel_address": ("10.0.0.1", "10.0.0.1"),
    "data_parallel_rpc_port": ("4000", 4000),
    "data_parallel_port": ("4001", 4001),
    "microbatching_token_threshold": ("8", 8),
    "dbo_decode_token_threshold": ("9", 9),
    "dbo_prefill_token_threshold": ("10", 10),
    "max_loras": ("2", 2),
    "max_lora_rank": ("8", 8),
    "max_cpu_loras": ("3", 3),
}


def _sample(f: Any) -> tuple[list[str], Any]:
    """Arguments setting `f` to a non-default value on a command line, and that value."""
    flag = option_strings(f)[0]
    meta = f.metadata
    if meta["const"] is not MISSING:
        return [flag], meta["const"]
    if isinstance(f.default, bool):
        return ([f"--no-{flag[2:]}"] if cli_default(f) else [flag]), not cli_default(f)
    if meta["choices"] is not None:
        choice = [c for c in meta["choices"] if c != f.default][-1]
        return [flag, choice], choice
    assert f.name in SAMPLES, f"add a sample value for the new setting {f.name!r} above"
    text, value = SAMPLES[f.name]
    return [flag, text], value


def _parse(command: str, argv: list[str]) -> EngineArgs:
    args = build_parser().parse_args([command, *argv])
    return EngineArgs.from_cli_args(args)


@pytest.mark.parametrize("command", COMMANDS)
def test_defaults_match_llm(command: str) -> None:
    parsed = _parse(command, [])
    for f in SETTINGS:
        expected = f.default
        if command == "serve" and f.metadata["commands"] == SERVE_ONLY:
            expected = cli_default(f)  # the server logs requests; LLM(...) does not
        assert getattr(parsed, f.name) == expected, f.name


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_reaches_its_field(command: str) -> None:
    for f in SETTINGS:
        if f.metadata["commands"] == SERVE_ONLY and command != "serve":
            with pytest.raises(SystemExit):
                _parse(command, [option_strings(f)[0]])
            continue
        argv, value = _sample(f)
        assert getattr(_parse(command, argv), f.name) == value, (command, argv)


def test_llm_passes_every_keyword(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[EngineArgs] = []
    monkeypatch.setattr(EngineArgs, "create_engine_config", lambda self: seen.append(self))
    monkeypatch.setattr(llm_module.LLM, "_start", lambda self, config: None)
    for f in SETTINGS:
        if f.name == "model":
            continue
        _, value = _sample(f)
        llm_module.LLM("/ckpt", **{f.name: value})
        assert getattr(seen[-1], f.name) == value, f.name
        assert seen[-1].model == "/ckpt"
    assert all(getattr(EngineArgs(), f.name) == f.default for f in SETTINGS)


def test_aliases_and_extra_flags() -> None:
    assert _parse("serve", ["--enable-dbo"]).enable_microbatching is True
    assert EngineArgs(enable_dbo=True).enable_microbatching is True
    assert _parse("generate", ["--compile"]).enforce_eager is False
    assert _parse("generate", ["-tp", "2"]).tensor_parallel_size == 2
    assert _parse("generate", ["--no-enable-prefix-caching"]).enable_prefix_caching is False


def test_unknown_keyword_is_named() -> None:
    with pytest.raises(TypeError, match="'max_num_seq'; did you mean 'max_num_seqs'"):
        build_engine_config(None, max_num_seq=4)


def test_bad_flag_value_is_an_argparse_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--max-num-seqs", "0"])
    assert "--max-num-seqs: expected an integer >= 1, got 0" in capsys.readouterr().err


def test_parser_has_one_flag_per_setting() -> None:
    parser = argparse.ArgumentParser()
    from tokenwise.entrypoints.engine_args import add_engine_args, add_request_log_args

    add_engine_args(parser)
    add_request_log_args(parser)
    dests = {a.dest for a in parser._actions} - {"help"}
    assert dests == {f.name for f in SETTINGS}
