"""`/v1/score`, the rerank endpoints and `/v1/classify`, with the bodies clients send.

One `tokenwise serve --task score` over a tiny BERT cross-encoder answers score and rerank;
expected numbers come from `LLM.score` on the same checkpoint (itself checked against HF in
tests/models/test_classifiers_vs_hf.py). Rerank bodies are written as the Jina API and the
Cohere clients (v1 `Client.rerank`, v2 `ClientV2.rerank`) serialize them: unset options are left
out, documents are strings or `{"text": ...}` objects. `/v1/classify` runs in this process over
a tiny Qwen3 classifier (`build_app` on an `AsyncEngine`), as no second server is needed.
"""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.entrypoints._server import RemoteServer, wait_for_idle
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise.entrypoints.llm import LLM
from tokenwise.entrypoints.openai.api_server import build_app
from tokenwise.entrypoints.openai.async_engine import AsyncEngine
from tokenwise.entrypoints.openai.metrics import ServerMetrics
from tokenwise.entrypoints.openai.server_config import ServerConfig

NAME = "tiny-reranker"
QUERY = "where does the cat sit"
DOCS = [
    "The cat sat on the mat.",
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "import os",
    "The dog sat on the log.",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    arch = "BertForSequenceClassification"
    return build_tiny_checkpoint(tmp_path_factory.mktemp("rerank"), arch, num_labels=1)


@pytest.fixture(scope="module", autouse=True)
def booting_server(model_dir: str):
    args = ("--served-model-name", NAME, "--task", "score")
    with RemoteServer(model_dir, *args, wait=False) as srv:
        yield srv


@pytest.fixture(scope="module")
def server(booting_server: RemoteServer) -> RemoteServer:
    return booting_server.wait_healthy()


@pytest.fixture(scope="module")
def expected(model_dir: str) -> list[float]:
    llm = LLM(model_dir, task="score", dtype="float32", device="cpu")
    return [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]


def post(server: RemoteServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json=body, timeout=60)


def test_score_one_to_many_and_pairwise(server: RemoteServer, expected: list[float]) -> None:
    body = post(server, "/v1/score", {"model": NAME, "text_1": QUERY, "text_2": DOCS}).json()
    assert body["object"] == "list" and body["model"] == NAME
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert all(d["object"] == "score" for d in body["data"])
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-6)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 4 * 4
    pairwise = {"model": NAME, "text_1": [QUERY, QUERY], "text_2": DOCS[2:]}
    scores = [d["score"] for d in post(server, "/v1/score", pairwise).json()["data"]]
    assert scores == pytest.approx(expected[2:], abs=1e-6)


def ranked(expected: list[float]) -> list[int]:
    return sorted(range(len(expected)), key=lambda i: -expected[i])


def test_jina_rerank(server: RemoteServer, expected: list[float]) -> None:
    jina = {
        "model": NAME,
        "query": QUERY,
        "top_n": 3,
        "documents": DOCS,
        "return_documents": True,
    }
    body = post(server, "/v1/rerank", jina).json()
    results = body["results"]
    assert [r["index"] for r in results] == ranked(expected)[:3]
    for r in results:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-6)
        assert r["document"] == {"text": DOCS[r["index"]]}
    assert body["usage"]["total_tokens"] > 0 and body["model"] == NAME
    # Jina's documents as objects, on vLLM's unversioned path; documents come back by default.
    objects = {"model": NAME, "query": QUERY, "documents": [{"text": d} for d in DOCS]}
    results = post(server, "/rerank", objects).json()["results"]
    assert [r["index"] for r in results] == ranked(expected)
    assert all(r["document"]["text"] == DOCS[r["index"]] for r in results)


def test_cohere_rerank_v1_and_v2(server: RemoteServer, expected: list[float]) -> None:
    v1 = {
        "model": NAME,
        "query": QUERY,
        "documents": [{"text": d} for d in DOCS],
        "top_n": 2,
        "rank_fields": ["text"],
        "return_documents": False,
    }
    body = post(server, "/v1/rerank", v1).json()
    assert [r["index"] for r in body["results"]] == ranked(expected)[:2]
    assert all(r.get("document") is None for r in body["results"])
    assert body["meta"]["api_version"]["version"] == "1" and body["id"]
    v2 = {"model": NAME, "query": QUERY, "documents": DOCS, "top_n": 10}
    body = post(server, "/v2/rerank", v2).json()
    assert [r["index"] for r in body["results"]] == ranked(expected)  # top_n past the end: all
    assert [r["relevance_score"] for r in body["results"]] == sorted(expected, reverse=True)
    assert all(r.get("document") is None for r in body["results"])
    assert body["meta"]["api_version"]["version"] == "2"
    assert body["meta"]["billed_units"]["search_units"] == 1


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/score", {"text_1": ["a", "b"], "text_2": DOCS}, "text_2", "1:N"),
        ("/v1/score", {"text_1": "", "text_2": "b"}, "text_1", "empty string"),
        ("/v1/score", {"text_1": 5, "text_2": "b"}, "text_1", "text_1"),
        ("/v1/score", {"text_1": "a"}, "text_2", "Field required"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents", "must not be empty"),
        ("/v1/rerank", {"query": "q", "documents": ["a", ""]}, "documents", "documents[1]"),
        ("/v1/rerank", {"query": "q", "documents": [{"title": "a"}]}, "documents", "'text'"),
        ("/v1/rerank", {"query": "", "documents": ["a"]}, "query", "empty string"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n", ">= 1"),
        ("/v2/rerank", {"documents": ["a"]}, "query", "Field required"),
        (
            "/v1/rerank",
            {"query": "q", "documents": ["a"], "rank_fields": ["title"]},
            "rank_fields",
            "only ['text']",
        ),
        (
            "/v2/rerank",
            {"query": "q", "documents": ["a"], "max_tokens_per_doc": 64},
            "max_tokens_per_doc",
            "not supported",
        ),
        (
            "/v1/rerank",
            {"query": "q", "documents": ["cat " * 600]},
            "documents",
            "max_model_len",
        ),
        ("/v1/classify", {"input": "a"}, "model", "--task classify; the model"),
        ("/v1/embeddings", {"input": "a"}, "model", "runs task 'score'"),
        ("/v1/completions", {"prompt": "a"}, "model", "is a scoring model (--task score)"),
    ],
)
def test_bad_requests_are_400_naming_the_field(
    server: RemoteServer, path: str, body: dict, param: str, words: str
) -> None:
    response = post(server, path, {"model": NAME, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_server_stays_clean(server: RemoteServer) -> None:
    post(server, "/v1/rerank", {"model": NAME, "query": "q", "documents": ["a", ""]})
    assert post(server, "/v1/score", {"model": NAME, "text_1": "a", "text_2": "b"}).is_success
    wait_for_idle(server)


def test_classify_endpoint(tmp_path_factory: pytest.TempPathFactory) -> None:
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    path = build_tiny_checkpoint(
        tmp_path_factory.mktemp("classify"), "Qwen3ForSequenceClassification", id2label=labels
    )
    llm = LLM(path, task="auto", dtype="float32", device="cpu")
    texts = ["The cat sat on the mat.", "import os", "a"]
    expected = [o.outputs.probs for o in llm.classify(texts, use_tqdm=False)]
    config = ServerConfig(served_model_name="clf", max_model_len=512, task="classify")
    app = build_app(AsyncEngine(llm.llm_engine), config, ServerMetrics("clf"))
    with TestClient(app) as http:
        body = http.post("/v1/classify", json={"model": "clf", "input": texts}).json()
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2]
        for data, probs in zip(body["data"], expected, strict=True):
            assert data["probs"] == pytest.approx(probs, abs=1e-6)
            assert data["num_classes"] == 3
            assert data["label"] == labels[max(range(3), key=probs.__getitem__)]
        one = http.post("/v1/classify", json={"model": "clf", "input": texts[1]}).json()
        assert one["data"][0]["probs"] == pytest.approx(expected[1], abs=1e-6)
        refused = http.post("/v1/rerank", json={"query": "q", "documents": ["a"]})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "model" and "--task score" in error["message"]
        empty = http.post("/v1/classify", json={"input": []})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"
