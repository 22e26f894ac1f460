"""Schema-driven fuzzing of `tokenwise serve`: schemathesis generates requests from the server's
own OpenAPI schema (/openapi.json) and sends them to a real server subprocess.

Why: test_server_errors.py checks the invalid inputs someone thought of; this sends the ones
nobody did (odd unions, huge or negative numbers, deep arrays, unknown keys, non-BMP and control
characters, malformed JSON).

What it promises, for about 210 generated cases (70 per generation route; the GET routes take
few parameters), positive (schema-valid) and negative (schema-violating):
- no 5xx, and no hang: every call has a 30 s timeout and every test a pytest timeout;
- every error is OpenAI's body (`error_of`), and a 200 event stream ends with `[DONE]` (with
  `response.completed` or `.incomplete` on /v1/responses) within the timeout and carries no
  error event (a 500 inside a stream is invisible to status checks);
- schema-violating bodies are refused with a 4xx (`negative_data_rejection`), and /v1 refuses
  requests without or with a wrong API key (`ignored_auth`, which probes each route once);
- afterwards nothing is left running or holding KV blocks, and a plain request still works.

Checks left out on purpose: `status_code_conformance` (FastAPI's schema declares only 200 and a
422 this server never sends; the server answers 400/401/404/413 with OpenAI's error body, which
the schema cannot declare without editing the routes), `content_type_conformance` (the schema
says application/json for /metrics, /health and event streams too), `response_schema_conformance`
(every 200 schema is `{}`) and `positive_data_acceptance` (the schema has no ranges or server
caps, so schema-valid bodies such as `max_tokens: 10**9` are rightly 400).

Every case sends the API key (OpenAPI-aware auth; security parameters are not generated, so
negative cases mutate the body rather than the Authorization header, and most cases get past
auth). Auth itself is covered by `ignored_auth` and by test_server_errors.py::test_auth.

Reproducible: Hypothesis runs derandomized (`derandomize=True`, no example database) and
schemathesis derives each route's seed from a fixed SEED, so every run sends the same cases. For
a longer hunt, set TOKENWISE_FUZZ_SEED and TOKENWISE_FUZZ_EXAMPLES (cases per generation route).

Depth: the schema states types but no ranges or server caps, so most positive cases are refused
with a 400 by SamplingParams or a cap (with the default seed, 16 of the 140 POST cases get a 200,
one of them a stream). This test is a net for input handling; generation itself is covered by
test_openai_server.py, test_server_load.py and test_soak.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import Case, CheckContext, Response
from schemathesis.checks import ignored_auth, negative_data_rejection, not_a_server_error

from tests.entrypoints._server import RemoteServer, metric_value, wait_for_idle
from tests.entrypoints.test_server_errors import COMPLETION, KEY, NAME, error_of, post
from tests.tiny_checkpoints import build_tiny_checkpoint

SEED = int(os.environ.get("TOKENWISE_FUZZ_SEED", "1234"))
EXAMPLES_PER_ROUTE = int(os.environ.get("TOKENWISE_FUZZ_EXAMPLES", "70"))
CALL_TIMEOUT_S = 30.0
# Small caps keep every generated case cheap: at most 4 prompts x 4 samples x 16 tokens.
CAPS = ("--max-model-len", "128", "--max-tokens-cap", "16", "--max-n", "4")
CAPS += ("--max-logprobs", "5", "--max-prompts", "4")
# Enough events for the largest stream the caps allow (4 x 4 x 16 tokens, role and usage
# chunks), so a stream cut short means one that did not end within CALL_TIMEOUT_S.
MAX_STREAM_EVENTS = 1000

pytestmark = pytest.mark.timeout(300)  # includes the server's start-up (up to 180 s)

FUZZ_SETTINGS: dict[str, Any] = {
    "deadline": None,  # real HTTP calls to a model on 2 cores: latency is not the subject
    "derandomize": True,
    "database": None,
    # Large generated bodies and filtered negative cases are expected here, not a problem.
    "suppress_health_check": list(HealthCheck),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    model_dir = build_tiny_checkpoint(tmp_path_factory.mktemp("fuzz"))
    args = ("--api-key", KEY, "--served-model-name", NAME, *CAPS)
    with RemoteServer(model_dir, *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(server: RemoteServer) -> schemathesis.BaseSchema:
    config = schemathesis.Config.from_dict(
        {
            "seed": SEED,
            "request-timeout": CALL_TIMEOUT_S,
            "max-stream-events": MAX_STREAM_EVENTS,
            "auth": {"openapi": {"HTTPBearer": {"bearer": KEY}}},
            # Failures print a curl command; the default would blank every field whose name
            # holds "token" (max_tokens, stop_token_ids, ...). The key is a test secret.
            "output": {"sanitization": {"enabled": False}},
            "generation": {"mode": "all", "with-security-parameters": False},
            # Only the fuzzing phase, whose size max_examples bounds: the schema has no
            # examples, and the coverage phase adds ~550 cases of its own regardless.
            "phases": {
                "examples": {"enabled": False},
                "coverage": {"enabled": False},
                "stateful": {"enabled": False},
            },
        }
    )
    return schemathesis.openapi.from_url(
        server.url("/openapi.json"), config=config, timeout=CALL_TIMEOUT_S
    )


@pytest.fixture(autouse=True)
def _node_id_for_schemathesis(request: pytest.FixtureRequest) -> None:
    """schemathesis 4.32's lazy loader reads and rewrites `node._nodeid`, which pytest 9.2 no
    longer has (a node keeps a NodeId in `_id`); without it every lazy test fails with an
    AttributeError. A plain attribute is enough: pytest's reports still read `node.nodeid`."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


def openai_errors_and_complete_streams(
    ctx: CheckContext, response: Response, case: Case
) -> bool | None:
    """A custom schemathesis check: errors have OpenAI's body (Anthropic's on its Messages
    routes); 200 streams finish cleanly."""
    anthropic = case.path.startswith("/v1/messages")
    if response.status_code >= 400 and anthropic:
        body = response.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["message"], body
        return None
    if response.status_code >= 400:
        # error_of reads status_code, text and json(), which schemathesis's Response has too.
        error_of(response, response.status_code)  # type: ignore[arg-type]
        return None
    content_type = response.headers.get("content-type", [""])[0]
    if not content_type.startswith("text/event-stream"):
        return None
    assert not response.stream_cut_short, f"stream did not end within {CALL_TIMEOUT_S}s"
    events = [e for e in response.text.split("\n\n") if e]
    if case.path == "/v1/responses":  # named events, no [DONE]: the last one ends the response
        types = [json.loads(e.split("data: ", 1)[1])["type"] for e in events]
        assert types and types[-1] in ("response.completed", "response.incomplete"), types[-3:]
        assert "error" not in types and "response.failed" not in types, types
        return None
    if anthropic:  # Anthropic's named events: message_stop ends the message
        types = [json.loads(e.split("data: ", 1)[1])["type"] for e in events]
        assert types and types[-1] == "message_stop" and "error" not in types, types[-3:]
        return None
    assert events and events[-1] == "data: [DONE]", events[-3:]
    for event in events[:-1]:
        assert event.startswith("data: {"), event
        assert "error" not in json.loads(event.removeprefix("data: ")), event
    return None


CHECKS = [
    not_a_server_error,
    negative_data_rejection,
    ignored_auth,
    openai_errors_and_complete_streams,
]

schema = schemathesis.pytest.from_fixture("api_schema")


@schema.include(method="POST").parametrize()
@settings(max_examples=EXAMPLES_PER_ROUTE, **FUZZ_SETTINGS)
def test_generation_routes(case: Case) -> None:
    case.call_and_validate(checks=CHECKS, timeout=CALL_TIMEOUT_S)


@schema.include(method="GET").parametrize()
@settings(max_examples=5, **FUZZ_SETTINGS)
def test_other_routes(case: Case) -> None:
    case.call_and_validate(checks=CHECKS, timeout=CALL_TIMEOUT_S)


def test_server_is_idle_and_still_serves(server: RemoteServer) -> None:
    """After the fuzz: healthy, nothing running or holding KV blocks, and still serving."""
    assert httpx.get(server.url("/health"), timeout=CALL_TIMEOUT_S).status_code == 200
    text = wait_for_idle(server, timeout=30.0)
    assert metric_value(text, "tokenwise:num_requests_running") == 0
    assert metric_value(text, "tokenwise:num_used_kv_blocks") == 0
    response = post(server, "/v1/completions", COMPLETION)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] in ("length", "stop")
