"""deploy/: the container image's Dockerfile and the Kubernetes example, checked here without
network or a container runtime.

The manifest is validated against Kubernetes' own JSON schema (`kubernetes-validate`, strict:
unknown fields fail), then against the server it runs: probes must hit routes the app really
answers without the API key, ports and names must line up, the key must come from the
Secret under the variable the server reads. hadolint is not on PyPI, so the Dockerfile gets a
small structural lint: known instructions, exec-form entrypoint and health check, a non-root
user, and the entrypoint's flags parsed by the real `tokenwise serve` parser.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from tests._optional import require
from tests.entrypoints._recording_engine import app_for
from tests.tiny_checkpoints import tiny_tokenizer
from tokenwise.entrypoints.cli import build_parser
from tokenwise.entrypoints.openai.cli_args import API_KEY_ENV

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "deploy" / "Dockerfile"
MANIFESTS = sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
    "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}  # fmt: skip


def pyproject() -> dict[str, Any]:
    tomllib = require("tomllib", "reading pyproject.toml (Python 3.11+)")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; comments dropped, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word, rest.strip()))
    return out


def instruction(name: str) -> list[str]:
    return [args for word, args in dockerfile() if word == name]


def exec_form(args: str) -> list[str]:
    """A JSON-array (exec form) argument; shell form is refused (signals skip a shell)."""
    assert args.startswith("["), f"use the exec (JSON array) form, got {args!r}"
    return json.loads(args)


def resources() -> list[dict[str, Any]]:
    docs = [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, "no manifests under deploy/kubernetes"
    return docs


def of_kind(kind: str) -> dict[str, Any]:
    (found,) = [d for d in resources() if d["kind"] == kind]
    return found


def container() -> dict[str, Any]:
    (c,) = of_kind("Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def test_dockerfile_instructions_are_sound() -> None:
    steps = dockerfile()
    assert all(word in INSTRUCTIONS for word, _ in steps), [w for w, _ in steps]
    assert steps[0] == ("FROM", "python:3.11-slim")
    pins = re.findall(r"\btorch==(\S+)", " ".join(instruction("RUN")))
    torch_req = next(
        Requirement(r)
        for r in pyproject()["project"]["dependencies"]
        if Requirement(r).name == "torch"
    )
    assert len(pins) == 1 and torch_req.specifier.contains(pins[0]), (pins, torch_req)
    assert any("download.pytorch.org/whl/cpu" in r for r in instruction("RUN"))
    for args in instruction("COPY"):
        *sources, _dest = shlex.split(args)
        assert all((REPO / s).exists() for s in sources), args
    # The user is set once, not root, after everything installed as root.
    (user,) = instruction("USER")
    assert user not in ("root", "0")
    words = [w for w, _ in steps]
    assert words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN")
    assert any(f"--uid {user}" in r for r in instruction("RUN"))


def test_dockerfile_entrypoint_is_the_real_serve_command() -> None:
    (entry,) = instruction("ENTRYPOINT")
    argv = exec_form(entry)
    scripts = pyproject()["project"]["scripts"]
    assert argv[0] in scripts and argv[1] == "serve"
    args = build_parser().parse_args(argv[1:] + container().get("args", []))
    (exposed,) = instruction("EXPOSE")
    assert args.host == "0.0.0.0" and args.port == int(exposed)
    (check,) = instruction("HEALTHCHECK")
    options, _, cmd = check.partition("CMD ")
    assert re.search(r"--timeout=\d+s", options) and re.search(r"--start-period=\d+s", options)
    probe = " ".join(exec_form(cmd))
    assert f"http://127.0.0.1:{args.port}/health" in probe


def test_manifests_validate_against_the_kubernetes_schema() -> None:
    kv = require("kubernetes_validate", "the Kubernetes JSON schema")
    version = kv.latest_version()
    for doc in resources():
        kv.validate(doc, version, strict=True)  # raises ValidationError naming the field


def test_manifests_fit_the_image_and_the_server() -> None:
    deployment, service, secret = of_kind("Deployment"), of_kind("Service"), of_kind("Secret")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    (exposed,) = instruction("EXPOSE")
    assert list(ports.values()) == [int(exposed)]
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports or port["targetPort"] in ports.values()
    # The API key: from the Secret, under the variable the server reads.
    (env,) = [e for e in c["env"] if e["name"] == API_KEY_ENV]
    ref = env["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"]
    assert ref["key"] in secret.get("stringData", {}) | secret.get("data", {})
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"]
    (user,) = instruction("USER")
    assert str(pod["securityContext"]["runAsUser"]) == user
    assert c["resources"]["requests"] and c["resources"]["limits"]


@pytest.mark.parametrize("probe", ["startupProbe", "livenessProbe", "readinessProbe"])
def test_probes_hit_routes_the_server_answers_without_the_key(probe: str) -> None:
    c = container()
    get = c[probe]["httpGet"]
    assert get["port"] in {p["name"] for p in c["ports"]} | {p["containerPort"] for p in c["ports"]}
    client, _ = app_for(tiny_tokenizer(), api_key="secret-key")
    with client:
        assert client.get(get["path"]).status_code == 200  # kubelet sends no key
        assert client.get("/v1/models").status_code == 401  # the key is really required
