"""The deployment's parts (deploy/), checked offline: every Kubernetes manifest against the official schemas
(kubernetes-validate, strict: no field the API would drop), the settings that keep replicas and sandboxes shut,
the HAProxy configuration by HAProxy itself, and the systemd unit's command line by the server's own parser."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from sandbox_server.cli.main import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERNETES_VERSION = "1.31.0"


def _documents() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted((DEPLOY / "kubernetes").rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                found.append((f"{path.relative_to(DEPLOY)}:{document['kind']}", document))
    return found


def _one(kind: str, folder: str = "kubernetes/") -> dict[str, Any]:
    matches = [doc for name, doc in _documents() if doc["kind"] == kind and name.startswith(folder)]
    assert len(matches) == 1, (kind, folder, len(matches))
    return matches[0]


@pytest.mark.parametrize(("name", "document"), _documents(), ids=[name for name, _ in _documents()])
def test_every_manifest_is_valid_kubernetes(name: str, document: dict[str, Any]) -> None:
    kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_a_manifest_with_a_misspelt_field_is_refused() -> None:
    """The validation above can fail: a field the API does not know is an error under strict."""
    pod = _one("Pod", "kubernetes/pods/")
    broken = {**pod, "spec": {**pod["spec"], "runtimeClasName": "gvisor"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_replicas_run_shut_and_probe_the_health_route() -> None:
    pod = _one("DaemonSet")["spec"]["template"]["spec"]
    (replica,) = pod["containers"]
    security = replica["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert security["capabilities"]["drop"] == ["ALL"] and not security.get("privileged", False)
    assert (
        pod["automountServiceAccountToken"] is False
        and pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    )
    assert replica["readinessProbe"]["httpGet"]["path"] == "/healthz"
    state = next(env for env in replica["env"] if env["name"] == "SANDBOX_STATE_URL")
    assert state["valueFrom"]["secretKeyRef"]["name"] == _one("Secret")["metadata"]["name"]
    parsed = build_parser().parse_args(replica["args"])  # every option the manifest passes is one `serve` takes
    # A rolling update drains one replica at a time, and waits for its grace period and its closing before a kill.
    strategy = _one("DaemonSet")["spec"]["updateStrategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}, strategy
    assert pod["terminationGracePeriodSeconds"] >= parsed.grace_s + 10


def test_sandbox_pods_run_under_gvisor_with_nothing_in_and_only_the_proxy_out() -> None:
    pod = _one("Pod", "kubernetes/pods/")["spec"]
    (sandbox,) = pod["containers"]
    assert pod["runtimeClassName"] == _one("RuntimeClass", "kubernetes/pods/")["metadata"]["name"] == "gvisor"
    assert pod["automountServiceAccountToken"] is False and not pod["hostNetwork"] and not pod["hostPID"]
    assert pod["securityContext"]["runAsNonRoot"] and sandbox["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert sandbox["stdin"] and sandbox["stdinOnce"] and "ports" not in sandbox  # reached over attach alone
    assert all(volume["emptyDir"]["sizeLimit"] for volume in pod["volumes"])
    policies = [
        doc for name, doc in _documents() if doc["kind"] == "NetworkPolicy" and name.startswith("kubernetes/pods/")
    ]
    sandboxes = next(
        doc for doc in policies if doc["spec"]["podSelector"]["matchLabels"] == {"sandbox-server.org/sandbox": "true"}
    )
    assert sandboxes["spec"]["ingress"] == [] and set(sandboxes["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    (only,) = sandboxes["spec"]["egress"]
    assert only["to"] == [{"podSelector": {"matchLabels": {"sandbox-server.org/egress-proxy": "true"}}}]


def test_haproxy_accepts_the_configuration() -> None:
    env = {**os.environ, "LISTEN": "127.0.0.1:8000", "REPLICA_1": "127.0.0.1:8001", "REPLICA_2": "127.0.0.1:8002"}
    checked = subprocess.run(
        ["haproxy", "-c", "-f", str(DEPLOY / "haproxy.cfg")], env=env, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_systemd_unit_starts_serve_with_options_it_takes() -> None:
    unit = (DEPLOY / "sandbox-server@.service").read_text().replace("\\\n", " ")
    (line,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    words = shlex.split(line.removeprefix("ExecStart="))
    assert words[0].endswith("/sandbox-server")
    parsed = build_parser().parse_args([word.replace("%i", "8000").replace("%H", "node") for word in words[1:]])
    assert parsed.transport == "http" and parsed.tokens and parsed.state is None  # the URL comes from the environment
    (stop,) = [line for line in unit.splitlines() if line.startswith("TimeoutStopSec=")]
    assert int(stop.removeprefix("TimeoutStopSec=")) >= parsed.grace_s + 10  # it drains before systemd kills
    assert "EnvironmentFile=" in unit and "SANDBOX_STATE_URL" in unit
