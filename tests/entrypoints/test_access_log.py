"""The access log in process (`access_log`): one line per HTTP request whatever its fate
(200, 404, 400, 413, an unexpected 500), none with `--disable-access-log`; and the serve flags
of this slice as the command line parses them. Token counts in the line, and the line as a
running server writes it: test_server_compat.py."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from tokenwise.engine.stats import EngineStats
from tokenwise.entrypoints.cli import build_parser
from tokenwise.entrypoints.openai.api_server import build_app
from tokenwise.entrypoints.openai.async_engine import AsyncEngine
from tokenwise.entrypoints.openai.cli_args import server_config_kwargs
from tokenwise.entrypoints.openai.metrics import ServerMetrics
from tokenwise.entrypoints.openai.server_config import ServerConfig

ACCESS = "tokenwise.server.access"


class _IdleEngine:
    """Enough of an engine for AsyncEngine to idle; `/detokenize`, which reads the model's
    vocabulary size, fails on it as a bug would (a 500)."""

    tokenizer = None

    def get_stats(self) -> EngineStats:
        return EngineStats()

    def has_unfinished_requests(self) -> bool:
        return False

    def check_health(self) -> None:
        pass

    def wakeup(self) -> None:
        pass


def app(access_log: bool, body_limit: int = 1 << 20):
    config = ServerConfig(
        served_model_name="m",
        max_model_len=64,
        access_log=access_log,
        max_request_body_bytes=body_limit,
    )
    return build_app(AsyncEngine(_IdleEngine()), config, ServerMetrics("m"))  # type: ignore[arg-type]


def access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ACCESS]


def test_every_request_gets_one_line_with_its_status(caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.INFO, logger=ACCESS),
        TestClient(app(True, 256), raise_server_exceptions=False) as http,
    ):
        assert http.get("/health").status_code == 200
        assert http.get("/no/such/route").status_code == 404
        assert http.post("/v1/completions", content=b"{not json").status_code == 400
        assert http.post("/v1/completions", json={"prompt": "x" * 1000}).status_code == 413
        assert http.post("/detokenize", json={"tokens": [1]}).status_code == 500
    lines = access_lines(caplog)
    expected = [
        ('"GET /health" 200', "id="),
        ('"GET /no/such/route" 404', "id="),
        ('"POST /v1/completions" 400', "id="),
        ('"POST /v1/completions" 413', "id="),
        ('"POST /detokenize" 500', "id="),
    ]
    assert len(lines) == len(expected), lines
    for line, (route_status, id_part) in zip(lines, expected, strict=True):
        assert route_status in line and id_part in line and line.endswith("s"), line
        assert "prompt_tokens" not in line  # no tokens were counted for any of these
    ids = [line.split("id=")[1].split()[0] for line in lines]
    assert len(set(ids)) == len(ids)  # each request its own id


def test_disabled_access_log_writes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=ACCESS), TestClient(app(False)) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/no/such/route").status_code == 404
    assert access_lines(caplog) == []


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], {"access_log": True, "strict_request_fields": False, "reasoning_parser": None}),
        (["--disable-access-log"], {"access_log": False}),
        (["--disable-uvicorn-access-log"], {"access_log": False}),  # vLLM's name
        (["--strict-request-fields"], {"strict_request_fields": True}),
        (["--reasoning-parser", "qwen3"], {"reasoning_parser": "qwen3"}),
    ],
)
def test_serve_flags(flags: list[str], expected: dict) -> None:
    args = build_parser().parse_args(["serve", *flags])
    kwargs = server_config_kwargs(args)
    assert {k: kwargs[k] for k in expected} == expected
    ServerConfig(served_model_name="m", max_model_len=8, **kwargs)  # a valid configuration


def test_unknown_reasoning_parser_fails_at_start_listing_the_valid_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--reasoning-parser", "r1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--reasoning-parser" in err and "'r1'" in err
    assert "deepseek_r1" in err and "qwen3" in err
    with pytest.raises(ValueError, match="deepseek_r1"):
        ServerConfig(served_model_name="m", max_model_len=8, reasoning_parser="r1")
