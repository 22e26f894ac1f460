"""Start `tokenwise serve` as a real subprocess for HTTP tests, and always stop it.

The server runs exactly as a user would run it (the CLI, uvicorn, a loopback port), so the
tests cover argument parsing, startup and shutdown too. Its output goes to a file (a pipe
nobody reads could fill up and block the server) and is shown when startup fails.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 180.0  # importing torch on a busy 2-core machine can take a while


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class RemoteServer:
    """`with RemoteServer(model_dir, "--api-key", "k") as server: server.url("/health")`.

    `launcher` is what runs `serve ...` after the interpreter: the real CLI by default, or a
    test module that wraps it (to plant a fault, say)."""

    def __init__(
        self,
        model_dir: str,
        *args: str,
        env: dict[str, str] | None = None,
        wait: bool = True,
        launcher: tuple[str, ...] = ("-m", "tokenwise.entrypoints.cli"),
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://{HOST}:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="tokenwise-serve-", suffix=".log")
        cmd = [
            sys.executable,
            *launcher,
            "serve",
            "--model",
            model_dir,
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--kv-cache-memory",
            "16MiB",
            *args,
        ]
        full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=os.getcwd()
        )
        self._healthy = False
        if wait:
            self.wait_healthy()

    def url(self, path: str) -> str:
        return self.base_url + path

    def wait_healthy(self) -> RemoteServer:
        """Block until /health answers 200 (stopping the server if it never does). Starting
        with wait=False lets a test load something else while the server boots."""
        if not self._healthy:
            try:
                self._poll_health()
            except BaseException:
                self.stop()
                raise
            self._healthy = True
        return self

    def _poll_health(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url("/health"), timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{self.log()}")

    def log(self, tail: int | None = 5000) -> str:
        """The server's output so far: its last `tail` characters (None: all of it)."""
        self._log.flush()
        with open(self._log.name, errors="replace") as f:
            text = f.read()
        return text if tail is None else text[-tail:]

    def metrics(self) -> str:
        response = httpx.get(self.url("/metrics"), timeout=10.0)
        response.raise_for_status()
        return response.text

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log.close()

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0.0 when the series is absent)."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.match(r"^([^{\s]+)(?:\{(.*)\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return 0.0


def wait_for_idle(server: RemoteServer, timeout: float = 30.0) -> str:
    """/metrics once nothing runs, waits or holds a KV block (fails after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        text = server.metrics()
        busy = [
            metric_value(text, name)
            for name in (
                "tokenwise:num_requests_running",
                "tokenwise:num_requests_waiting",
                "tokenwise:num_used_kv_blocks",
                "tokenwise:kv_cache_usage_perc",
            )
        ]
        if not any(busy):
            return text
        assert time.monotonic() < deadline, f"server still busy: {busy}"
        time.sleep(0.2)


def openai_client(server: RemoteServer) -> Any:
    """The official client on `server`: no retries (a test must see the first answer)."""
    from openai import OpenAI

    return OpenAI(base_url=server.url("/v1"), api_key="unused", timeout=60.0, max_retries=0)
