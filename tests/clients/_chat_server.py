"""The built-in model, given a chat template, served for the client tests (see conftest.py).

The built-in model ships without a chat template (it is a code model); chat clients need one,
so the checkpoint is copied to a temporary directory with a small template that renders
messages, tool calls, tool results and the tools themselves. The model is served under
`SERVED_NAME`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from tests.entrypoints._server import RemoteServer
from tokenwise.default_model import DEFAULT_MODEL_DIR

SERVED_NAME = "tiny"
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m.get('tool_calls') %}{{ m['tool_calls'] | tojson }}{% endif %}"
    "{% if m.get('tool_call_id') %} ({{ m['tool_call_id'] }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@contextmanager
def chat_server(workdir: str, *args: str) -> Iterator[RemoteServer]:
    """`tokenwise serve` of the built-in model with `CHAT_TEMPLATE`, stopped on exit."""
    model_dir = os.path.join(workdir, "default-chat")
    shutil.copytree(DEFAULT_MODEL_DIR, model_dir)
    with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    with RemoteServer(model_dir, "--served-model-name", SERVED_NAME, *args) as server:
        yield server
