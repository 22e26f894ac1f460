"""`/v1/embeddings` through the official `openai` client against `tokenwise serve --task embed`.

Expected vectors come from `LLM.embed` on the same checkpoint in this process (itself checked
against HF in tests/models/test_bert_vs_hf.py); prompt token counts from the tokenizer.
"""

from __future__ import annotations

import base64
import struct
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from openai import OpenAI

from tests.entrypoints._server import RemoteServer, openai_client, wait_for_idle
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise.engine.stats import EngineStats
from tokenwise.entrypoints.llm import LLM
from tokenwise.entrypoints.openai.api_server import build_app
from tokenwise.entrypoints.openai.async_engine import AsyncEngine
from tokenwise.entrypoints.openai.metrics import ServerMetrics
from tokenwise.entrypoints.openai.server_config import ServerConfig

NAME = "tiny-bert"
TEXTS = ["Hello world", "The cat sat on the mat. The dog sat on the log.", "a"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("embed-server"), "BertModel")


@pytest.fixture(scope="module", autouse=True)
def booting_server(model_dir: str):
    args = ("--served-model-name", NAME, "--task", "embed", "--max-num-batched-tokens", "32")
    with RemoteServer(model_dir, *args, wait=False) as srv:
        yield srv


@pytest.fixture(scope="module")
def server(booting_server: RemoteServer) -> RemoteServer:
    return booting_server.wait_healthy()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, task="embed", dtype="float32", device="cpu")


def test_embeddings_equal_llm_embed(llm: LLM, client: OpenAI) -> None:
    expected = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    # The client asks for base64 unless told otherwise, and decodes it: both paths.
    for fmt in ("float", None):
        kwargs = {"encoding_format": fmt} if fmt else {}
        out = client.embeddings.create(input=TEXTS, model=NAME, **kwargs)
        assert out.object == "list" and out.model == NAME
        assert [d.index for d in out.data] == [0, 1, 2]
        assert all(d.object == "embedding" for d in out.data)
        got = torch.tensor([d.embedding for d in out.data])
        torch.testing.assert_close(got, torch.tensor(expected), atol=1e-6, rtol=0)
        tokens = sum(len(llm.get_tokenizer()(t)["input_ids"]) for t in TEXTS)
        assert out.usage.prompt_tokens == tokens == out.usage.total_tokens


def test_base64_is_little_endian_float32(llm: LLM, server: RemoteServer) -> None:
    body = {"model": NAME, "input": TEXTS[1], "encoding_format": "base64"}
    data = httpx.post(server.url("/v1/embeddings"), json=body, timeout=60).json()["data"]
    raw = base64.b64decode(data[0]["embedding"])
    floats = struct.unpack(f"<{len(raw) // 4}f", raw)
    expected = llm.embed(TEXTS[1], use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(floats), torch.tensor(expected), atol=1e-6, rtol=0)


def test_token_id_inputs(llm: LLM, client: OpenAI) -> None:
    ids = [llm.get_tokenizer()(t)["input_ids"] for t in TEXTS[:2]]
    expected = [o.outputs.embedding for o in llm.embed(TEXTS[:2], use_tqdm=False)]
    one = client.embeddings.create(input=ids[0], model=NAME, encoding_format="float")
    many = client.embeddings.create(input=ids, model=NAME, encoding_format="float")
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), torch.tensor(expected[0]))
    torch.testing.assert_close(
        torch.tensor([d.embedding for d in many.data]), torch.tensor(expected)
    )
    assert many.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_score_and_rerank_by_cosine_similarity(llm: LLM, server: RemoteServer) -> None:
    """An embedding model scores as in vLLM: the cosine of the two texts' embeddings."""
    query = "where does the cat sit"
    vectors = torch.tensor([o.outputs.embedding for o in llm.embed([query, *TEXTS])])
    expected = torch.nn.functional.cosine_similarity(vectors[:1], vectors[1:]).tolist()
    body = {"model": NAME, "query": query, "documents": TEXTS}
    reranked = httpx.post(server.url("/v1/rerank"), json=body, timeout=60).json()
    order = sorted(range(len(TEXTS)), key=lambda i: -expected[i])
    assert [r["index"] for r in reranked["results"]] == order
    for r in reranked["results"]:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)
    tokenizer = llm.get_tokenizer()
    tokens = sum(len(tokenizer(t)["input_ids"]) for t in [query, *TEXTS])
    assert reranked["usage"]["prompt_tokens"] == tokens  # each distinct text embedded once
    body = {"model": NAME, "text_1": query, "text_2": TEXTS[:2]}
    scores = httpx.post(server.url("/v1/score"), json=body, timeout=60).json()["data"]
    assert [d["score"] for d in scores] == pytest.approx(expected[:2], abs=1e-5)
    refused = httpx.post(server.url("/v1/classify"), json={"input": "a"}, timeout=60)
    assert refused.status_code == 400 and "runs task 'embed'" in refused.json()["error"]["message"]


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"input": ["Hello"], "dimensions": 8}, "dimensions", "dimensions=8"),
        ({"input": []}, "input", "empty list"),
        ({"input": ""}, "input", "empty string"),
        ({"input": ["ok", ""]}, "input", "input[1]"),
        ({"input": [[5, 6], []]}, "input", "input[1]"),
        ({"input": " ".join(["cat"] * 40)}, "input", "max_num_batched_tokens=32"),
        ({"input": [[10**6]]}, "input", "out of range"),
    ],
)
def test_bad_requests_are_400_naming_the_problem(
    client: OpenAI, kwargs: dict, param: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=NAME, encoding_format="float", **kwargs)
    error = info.value.body
    assert error["param"] == param and words in error["message"]


def test_generation_is_refused_and_the_server_stays_clean(
    client: OpenAI, server: RemoteServer
) -> None:
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.completions.create(model=NAME, prompt="Hello", max_tokens=4)
    with pytest.raises(openai.NotFoundError, match="the model 'other' does not exist"):
        client.embeddings.create(model="other", input="Hello")
    client.embeddings.create(input=TEXTS, model=NAME)  # still serving
    wait_for_idle(server)


class _GenerativeEngine:
    """Enough of LLMEngine for AsyncEngine; a generative model that must never be asked."""

    tokenizer = None
    model_config = SimpleNamespace(max_model_len=64, task="generate")

    def __init__(self) -> None:
        self.added: list[str] = []

    def get_stats(self) -> EngineStats:
        return EngineStats()

    def check_health(self) -> None:  # alive as long as the test wants it
        pass

    def wakeup(self) -> None:  # step() never waits
        pass

    def has_unfinished_requests(self) -> bool:
        return False

    def add_request(self, request_id: str, prompt, params) -> None:
        self.added.append(request_id)

    def abort_request(self, request_ids) -> None:
        pass


def test_generative_server_refuses_embeddings() -> None:
    inner = _GenerativeEngine()
    config = ServerConfig(served_model_name="llama", max_model_len=64)
    assert config.task == "generate"
    app = build_app(AsyncEngine(inner), config, ServerMetrics("llama"))  # type: ignore[arg-type]
    with TestClient(app) as http:
        response = http.post("/v1/embeddings", json={"model": "llama", "input": "Hello"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "model" and "--task embed" in error["message"]
    assert inner.added == []
