"""One server for the whole directory's client tests (the openai-agents module keeps its own:
it serves the SDK's default model name). Started on first use, stopped at the session's end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.clients._chat_server import chat_server
from tests.entrypoints._server import RemoteServer


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    with chat_server(str(tmp_path_factory.mktemp("clients"))) as srv:
        yield srv
