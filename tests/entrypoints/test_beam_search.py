"""Beam search (`LLM.beam_search`, `use_beam_search` on `/v1/completions`) equals Hugging Face's
`generate(num_beams=k, num_return_sequences=k, do_sample=False)` token for token.

The tiny fp32 Llama gets a second EOS id (143, a token its beams often pick) in its
generation_config.json, so beams end at EOS at various lengths, some hypotheses are finished
early and others at `max_tokens`, and the early-stopping rules matter (True and False give
different beams at width 4). Both sides read the same EOS ids, so two EOS ids also exercise the
candidate count `(1 + #EOS) * beam_width`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from functools import cache
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from tests.engine._fixtures import assert_pool_clean, tokenizer
from tests.entrypoints._server import RemoteServer
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise import LLM, BeamSearchParams, SamplingParams
from tokenwise.entrypoints.openai.api_server import build_app
from tokenwise.entrypoints.openai.async_engine import AsyncEngine
from tokenwise.entrypoints.openai.metrics import ServerMetrics
from tokenwise.entrypoints.openai.server_config import ServerConfig

EOS = (0, 143)
MAX_TOKENS = 16
TEXTS = ("The quick brown", "Hello world! Hello", "Once upon a time")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("beam"))
    gen_path = os.path.join(path, "generation_config.json")
    with open(gen_path) as f:
        gen = json.load(f)
    gen["eos_token_id"] = list(EOS)
    with open(gen_path, "w") as f:
        json.dump(gen, f)
    return path


@pytest.fixture(scope="module")
def llm(model_dir: str) -> Iterator[LLM]:
    engine = LLM(model_dir, dtype="float32", max_model_len=128, num_gpu_blocks=128)
    assert set(engine.llm_engine.eos_token_ids) == set(EOS)
    yield engine
    engine.shutdown()


def _prompts() -> list[list[int]]:
    return [tokenizer().encode(text) for text in TEXTS]


@cache
def _hf_model(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@cache
def _hf_beams(
    path: str,
    prompt: tuple[int, ...],
    width: int,
    early_stopping: Any,
    length_penalty: float,
    ignore_eos: bool = False,
    max_tokens: int = MAX_TOKENS,
) -> tuple[tuple[tuple[int, ...], float], ...]:
    """HF's `width` sequences (output tokens up to and including the first EOS) and scores."""
    kwargs: dict[str, Any] = {"eos_token_id": None} if ignore_eos else {}
    with torch.no_grad():
        out = _hf_model(path).generate(
            torch.tensor([list(prompt)]),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=max_tokens,
            early_stopping=early_stopping,
            length_penalty=length_penalty,
            return_dict_in_generate=True,
            output_scores=True,
            pad_token_id=EOS[0],
            **kwargs,
        )
    beams = []
    for row, score in zip(out.sequences.tolist(), out.sequences_scores.tolist(), strict=True):
        tokens = row[len(prompt) :]
        ends = [i for i, t in enumerate(tokens) if t in EOS and not ignore_eos]
        beams.append((tuple(tokens[: ends[0] + 1] if ends else tokens), score))
    return tuple(beams)


SETTINGS = [(False, 1.0), (True, 1.0), ("never", 2.0), (False, -0.5)]


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize(("early_stopping", "length_penalty"), SETTINGS)
def test_beams_equal_hugging_face(
    llm: LLM, model_dir: str, width: int, early_stopping: Any, length_penalty: float
) -> None:
    prompts = _prompts()
    params = BeamSearchParams(
        beam_width=width,
        max_tokens=MAX_TOKENS,
        early_stopping=early_stopping,
        length_penalty=length_penalty,
    )
    outputs = llm.beam_search(prompts, params)
    tok = tokenizer()
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = _hf_beams(model_dir, tuple(prompt), width, early_stopping, length_penalty)
        assert [tuple(s.output_token_ids) for s in output.sequences] == [e[0] for e in expected]
        for seq, (tokens, score) in zip(output.sequences, expected, strict=True):
            assert seq.tokens[: len(prompt)] == prompt
            assert seq.score == pytest.approx(score, abs=1e-4)
            assert seq.cum_logprob == pytest.approx(score * len(tokens) ** length_penalty, abs=1e-3)
            stopped = tokens[-1] in EOS
            assert seq.finish_reason == ("stop" if stopped else "length")
            assert seq.text == tok.decode(list(tokens[:-1] if stopped else tokens))
    assert_pool_clean(llm.llm_engine)


def test_the_settings_matter(model_dir: str) -> None:
    """The comparison above is not vacuous: beams end at EOS and at max_tokens, and HF's
    early_stopping True and False choose different beams here."""
    found = [_hf_beams(model_dir, tuple(p), 4, False, 1.0) for p in _prompts()]
    lengths = {len(tokens) for beams in found for tokens, _ in beams}
    assert MAX_TOKENS in lengths and min(lengths) < MAX_TOKENS
    early = [_hf_beams(model_dir, tuple(p), 4, True, 1.0) for p in _prompts()]
    assert early != found


@pytest.mark.parametrize("early_stopping", [False, "never"])
def test_never_bounds_running_beams_at_max_tokens(
    llm: LLM, model_dir: str, early_stopping: Any
) -> None:
    """A longer search where the heuristic stop (False) and the canonical one ("never") part:
    both equal HF, and they differ from each other."""
    prompt = tokenizer().encode("def fibonacci(n):")
    params = BeamSearchParams(beam_width=2, max_tokens=40, early_stopping=early_stopping)
    (output,) = llm.beam_search([prompt], params)
    expected = _hf_beams(model_dir, tuple(prompt), 2, early_stopping, 1.0, max_tokens=40)
    assert [tuple(s.output_token_ids) for s in output.sequences] == [e[0] for e in expected]
    other = _hf_beams(
        model_dir,
        tuple(prompt),
        2,
        "never" if early_stopping is False else False,
        1.0,
        max_tokens=40,
    )
    assert other != expected


def test_ignore_eos_runs_every_beam_to_max_tokens(llm: LLM, model_dir: str) -> None:
    prompt = _prompts()[0]
    params = BeamSearchParams(beam_width=2, max_tokens=MAX_TOKENS, ignore_eos=True)
    (output,) = llm.beam_search([prompt], params)
    expected = _hf_beams(model_dir, tuple(prompt), 2, False, 1.0, ignore_eos=True)
    assert [tuple(s.output_token_ids) for s in output.sequences] == [e[0] for e in expected]
    assert all(len(s.output_token_ids) == MAX_TOKENS for s in output.sequences)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"beam_width": 0}, "beam_width must be an integer >= 1, got 0"),
        ({"beam_width": 2.0}, "beam_width must be an integer >= 1"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
        ({"temperature": 0.7}, "temperature must be 0 for beam search"),
        ({"length_penalty": float("nan")}, "length_penalty must be a finite number"),
        ({"early_stopping": "sometimes"}, "early_stopping must be true, false or 'never'"),
        ({"early_stopping": 1}, "early_stopping must be true, false or 'never'"),
        ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
    ],
)
def test_bad_params_name_the_parameter(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **fields})


def test_bad_calls_are_clear_errors(llm: LLM) -> None:
    with pytest.raises(TypeError, match="params must be a BeamSearchParams, got SamplingParams"):
        llm.beam_search(_prompts(), SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^max_tokens=200 with a prompt of \d+ tokens exceeds"):
        llm.beam_search(_prompts(), BeamSearchParams(beam_width=2, max_tokens=200))
    assert_pool_clean(llm.llm_engine)


# ---- the server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server_llm(model_dir: str) -> Iterator[LLM]:
    """The server's own engine: its thread owns it, so `llm` stays the test's to drive."""
    engine = LLM(model_dir, dtype="float32", max_model_len=128, num_gpu_blocks=128)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server_llm: LLM) -> Iterator[TestClient]:
    config = ServerConfig(served_model_name="tiny", max_model_len=128)
    metrics = ServerMetrics("tiny")
    engine = AsyncEngine(server_llm.llm_engine, observer=metrics.observe)  # type: ignore[arg-type]
    metrics.attach_engine(lambda: engine.stats)
    with TestClient(build_app(engine, config, metrics)) as test_client:
        yield test_client


@pytest.mark.parametrize(("early_stopping", "length_penalty"), [(False, 1.0), (True, 1.0)])
def test_server_returns_the_same_beams(
    llm: LLM, server_llm: LLM, client: TestClient, early_stopping: bool, length_penalty: float
) -> None:
    prompts = _prompts()[:2]
    body = {
        "prompt": prompts,
        "n": 4,
        "use_beam_search": True,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "early_stopping": early_stopping,
        "length_penalty": length_penalty,
    }
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    params = BeamSearchParams(
        beam_width=4,
        max_tokens=MAX_TOKENS,
        early_stopping=early_stopping,
        length_penalty=length_penalty,
    )
    expected = [s for out in llm.beam_search(prompts, params) for s in out.sequences]
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(8))
    assert [c["text"] for c in choices] == [s.text for s in expected]
    assert [c["finish_reason"] for c in choices] == [s.finish_reason for s in expected]
    usage = reply["usage"]
    assert usage["prompt_tokens"] == sum(len(p) for p in prompts)
    assert usage["completion_tokens"] == sum(len(s.output_token_ids) for s in expected)
    assert not server_llm.llm_engine.has_unfinished_requests()
    bm = server_llm.llm_engine.block_manager
    assert bm.get_num_free_blocks() == bm.num_blocks


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 0}, "n"),
        ({"temperature": 0.7}, "temperature"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        ({"stream": True}, "stream"),
        ({"logprobs": 2}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"max_tokens": 500}, "max_tokens"),
    ],
)
def test_server_refuses_bad_beam_search_fields(
    client: TestClient, fields: dict[str, Any], param: str
) -> None:
    body = {"prompt": "Hello", "n": 2, "use_beam_search": True, "max_tokens": 8, **fields}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.timeout(240)
def test_tokenwise_serve_runs_beam_search_and_priorities(llm: LLM, model_dir: str) -> None:
    """The real server (`tokenwise serve`: its engine in a core process), with the priority
    policy: beam search through the core client returns `LLM.beam_search`'s beams, and a
    request's `priority` is taken."""
    prompts = _prompts()[:2]
    params = BeamSearchParams(beam_width=2, max_tokens=MAX_TOKENS)
    expected = [s.text for out in llm.beam_search(prompts, params) for s in out.sequences]
    args = ("--dtype", "float32", "--max-model-len", "128", "--scheduling-policy", "priority")
    with RemoteServer(model_dir, *args) as server:
        body = {"prompt": prompts, "n": 2, "use_beam_search": True, "max_tokens": MAX_TOKENS}
        reply = httpx.post(server.url("/v1/completions"), json=body, timeout=120.0)
        assert reply.status_code == 200, reply.text
        choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in choices] == expected
        plain = {"prompt": prompts[0], "max_tokens": 4, "priority": -3}
        assert (
            httpx.post(server.url("/v1/completions"), json=plain, timeout=60.0).status_code == 200
        )
