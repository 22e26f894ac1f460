"""The one INFO line per finished request (`LLMEngine._forget`) and its switch.

request r1 finished: stop, 12 prompt + 40 output tokens, ttft 0.031 s, total 0.412 s
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch

from tests.engine._fixtures import LLAMA, NUM_BLOCKS, checkpoint, random_ids
from tokenwise import LLM, SamplingParams
from tokenwise.entrypoints.cli import build_parser
from tokenwise.entrypoints.engine_args import engine_kwargs

LINE = re.compile(
    r"request (?P<id>\S+) finished: (?P<reason>[a-z/]+), (?P<prompt>\d+) prompt \+ "
    r"(?P<output>\d+) output tokens, ttft (?P<ttft>[\d.]+ s|-), total (?P<total>[\d.]+) s$"
)


def make_llm(**kwargs: Any) -> LLM:
    return LLM(checkpoint(LLAMA), dtype="float32", num_gpu_blocks=NUM_BLOCKS, **kwargs)


@pytest.fixture(scope="module")
def logging_llm() -> LLM:
    return make_llm(disable_log_requests=False)


def prompt(seed: int, length: int) -> list[int]:
    return random_ids(torch.Generator().manual_seed(seed), length)


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def finished_lines(caplog: pytest.LogCaptureFixture) -> dict[str, list[dict[str, str]]]:
    """The request lines logged on `tokenwise.engine`, parsed, by request id."""
    lines: dict[str, list[dict[str, str]]] = {}
    for record in caplog.records:
        if record.name == "tokenwise.engine" and record.getMessage().startswith("request "):
            assert record.levelno == logging.INFO
            match = LINE.match(record.getMessage())
            assert match, record.getMessage()
            lines.setdefault(match["id"], []).append(match.groupdict())
    return lines


def run(llm: LLM) -> None:
    engine = llm.llm_engine
    for _ in range(200):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("requests did not finish")


def test_one_line_per_finished_request_with_counts_and_reason(
    logging_llm: LLM, caplog: pytest.LogCaptureFixture
) -> None:
    engine = logging_llm.llm_engine
    p = prompt(1, 12)
    [ref] = logging_llm.generate([p], greedy(8), use_tqdm=False)
    ids = ref.outputs[0].token_ids
    j = next(j for j in range(1, len(ids)) if ids[j] not in ids[:j])  # a first occurrence
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tokenwise.engine"):
        engine.add_request("len", prompt(2, 10), greedy(5))
        engine.add_request("stop", p, greedy(8, stop_token_ids=[ids[j]]))
        engine.add_request("n2", prompt(3, 7), SamplingParams(n=2, seed=1, max_tokens=3))
        engine.add_request("abort-running", prompt(4, 9), greedy(20))
        engine.step()  # prefill: every request has its first token
        engine.abort_request("abort-running")
        engine.add_request("abort-waiting", prompt(5, 6), greedy(4))
        engine.abort_request("abort-waiting")
        run(logging_llm)
    lines = finished_lines(caplog)
    assert {rid: len(found) for rid, found in lines.items()} == {
        "len": 1,
        "stop": 1,
        "n2": 1,
        "abort-running": 1,
        "abort-waiting": 1,
    }
    got = {
        rid: (f[0]["reason"], int(f[0]["prompt"]), int(f[0]["output"])) for rid, f in lines.items()
    }
    assert got == {
        "len": ("length", 10, 5),
        "stop": ("stop", 12, j + 1),  # the stop token is an output token
        "n2": ("length", 7, 6),  # both samples' tokens
        "abort-running": ("abort", 9, 1),
        "abort-waiting": ("abort", 6, 0),
    }
    assert lines["abort-waiting"][0]["ttft"] == "-"  # no token ever came
    for rid in ("len", "stop", "n2", "abort-running"):
        ttft = float(lines[rid][0]["ttft"].removesuffix(" s"))
        assert 0 <= ttft <= float(lines[rid][0]["total"])


def test_no_line_from_the_offline_llm_by_default_or_when_disabled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    for llm in (make_llm(), make_llm(disable_log_requests=True)):
        assert not llm.llm_engine.config.log_requests
        with caplog.at_level(logging.INFO, logger="tokenwise.engine"):
            outs = llm.generate([prompt(6, 8)], greedy(3), use_tqdm=False)
        assert outs[0].outputs[0].finish_reason == "length"
        assert finished_lines(caplog) == {}


@pytest.mark.parametrize(
    ("argv", "disabled"),
    [
        (["serve"], False),  # the server logs requests by default
        (["serve", "--disable-log-requests"], True),
        (["generate", "hi"], True),  # offline commands never do
    ],
)
def test_disable_log_requests_flag(argv: list[str], disabled: bool) -> None:
    args = build_parser().parse_args(argv)
    assert engine_kwargs(args)["disable_log_requests"] is disabled
