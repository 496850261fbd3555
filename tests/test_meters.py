"""Meters: what each call used, in its answer and its audit record, summed by `sandbox-server usage`, and
scraped from `/metrics` by a real Prometheus (Debian's, started by the test in a folder of its own, scraping
this machine's loopback alone).

The sandboxes' CPU time and peak memory are the host's reading of their cgroups; the programs here use known
amounts of both, so the readings are checked against what was spent, not only that they exist.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from mcp.client.streamable_http import streamable_http_client

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.conftest import run_cli
from tests.mcp_harness import (
    CheckedClient,
    ServerProcess,
    answer,
    audit_records,
    connect,
    free_port,
    http_server_process,
    preloaded,
)

pytestmark = pytest.mark.anyio

METRICS_TOKEN = "metrics-" + "0123456789abcdef" * 2
BURN = """
import time
started = time.process_time()
while time.process_time() - started < 0.8:
    pass
held = b"x" * (160 * 1024 * 1024)
with open("/workspace/data.bin", "wb") as out:
    out.write(b"y" * (3 * 1024 * 1024))
print("spent")
"""


@dataclass
class Metered:
    server: ServerProcess
    audit: Path
    tokens: dict[str, str]


@pytest.fixture(scope="module")
def metered(runtime: DockerRuntime, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Metered]:
    folder = tmp_path_factory.mktemp("meters")
    tokens_file, audit, secret = folder / "tokens.json", folder / "audit.jsonl", folder / "metrics-token"
    secret.write_text(METRICS_TOKEN + "\n")
    tokens = {}
    for name in ("alice", "bob"):
        added = run_cli("token", "add", name, "--policy", "default", "--tokens", str(tokens_file))
        assert added.returncode == 0, added.stderr
        tokens[name] = added.stdout.strip().splitlines()[-1]
    serve = ("--tokens", str(tokens_file), "--audit-log", str(audit), "--metrics-token-file", str(secret))
    with http_server_process(*serve, env={"SANDBOX_STATE_DIR": str(folder / "state")}) as server:
        yield Metered(server, audit, tokens)


@asynccontextmanager
async def as_caller(metered: Metered, name: str) -> AsyncIterator[CheckedClient]:
    headers = {"Authorization": f"Bearer {metered.tokens[name]}"}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=300)) as http:
        async with connect(streamable_http_client(metered.server.url, http_client=http)) as client:
            yield client


async def call(client: CheckedClient, tool: str, **arguments: Any) -> dict[str, Any]:
    return await answer(client, tool, arguments)  # checked against the tool's outputSchema


def audit_of(metered: Metered) -> list[dict[str, Any]]:
    return audit_records(metered.audit)


async def test_a_call_says_the_cpu_memory_and_workspace_its_sandbox_used_and_the_audit_records_the_same(
    metered: Metered, runtime: DockerRuntime
) -> None:
    async with as_caller(metered, "alice") as alice:
        burned = await call(alice, "run_python", code=BURN)
        assert not burned["is_error"] and burned["stdout"] == "spent\n", burned["text"]
        usage = burned["usage"]
        assert 0.75 <= usage["cpu_s"] <= usage["wall_s"], usage
        assert usage["peak_memory_bytes"] >= 160 * 1024 * 1024, usage
        assert usage["workspace_bytes"] >= 3 * 1024 * 1024, usage
        assert usage["network_in_bytes"] == usage["network_out_bytes"] == 0
        # A warm interpreter imported its libraries before the call: that CPU time is not the call's.
        await preloaded(runtime.api, metered.audit)  # the next container too (it preloads while the first call runs)
        quick = await call(alice, "run_python", code="print(1 + 1)")
        assert quick["usage"]["cpu_s"] < 0.25, quick["usage"]
        shell = await call(alice, "execute_command", command="true")
        assert shell["usage"]["cpu_s"] < 0.25 and shell["usage"]["peak_memory_bytes"] > 0, shell["usage"]
    records = [r for r in audit_of(metered) if r.get("caller") == "alice"]
    assert [r["usage"] for r in records[-3:]] == [burned["usage"], quick["usage"], shell["usage"]]
    assert "cpu_s" not in records[-1]  # said once, in `usage`


async def test_a_refused_call_is_metered_too_and_usage_sums_the_audit_trail_by_caller_and_tool(
    metered: Metered,
) -> None:
    async with as_caller(metered, "bob") as bob:
        refused = await call(bob, "analyze_csv", filepath="../../etc/passwd", operations=["count"])
        assert refused["is_error"] and refused["error"]["kind"] == "refused", refused["text"]
        assert refused["usage"]["cpu_s"] is None and refused["usage"]["wall_s"] >= 0
        await call(bob, "execute_command", command="head -c 200000 /dev/urandom | sha256sum")
    records = [r for r in audit_of(metered) if "tool" in r and "event" not in r]

    shown = run_cli("usage", "--audit-log", str(metered.audit), "--json")
    assert shown.returncode == 0, shown.stderr
    totals = json.loads(shown.stdout)["totals"]
    for caller in ("alice", "bob"):
        theirs = [r for r in records if r.get("caller") == caller]
        assert totals[caller]["calls"] == len(theirs)
        assert totals[caller]["refused"] == sum(r["outcome"] == "refused" for r in theirs)
        assert totals[caller]["cpu_s"] == round(sum(r["usage"]["cpu_s"] or 0 for r in theirs), 3)
        assert totals[caller]["peak_memory_bytes"] == max(r["usage"]["peak_memory_bytes"] or 0 for r in theirs)

    by_tool = json.loads(run_cli("usage", "--audit-log", str(metered.audit), "--json", "--by", "tool").stdout)
    assert by_tool["totals"]["run_python"]["calls"] == sum(r["tool"] == "run_python" for r in records)
    later = run_cli("usage", "--audit-log", str(metered.audit), "--json", "--since", "2099-01-01")
    assert json.loads(later.stdout)["totals"] == {}
    table = run_cli("usage", "--audit-log", str(metered.audit), "--by", "tool")
    assert table.stdout.splitlines()[0].split()[:3] == ["tool", "calls", "ok"], table.stdout
    wrong = run_cli("usage", "--audit-log", str(metered.audit), "--since", "yesterday-ish")
    assert wrong.returncode == 2 and "--since 'yesterday-ish'" in wrong.stderr


async def test_a_stopped_service_says_how_long_it_ran_and_what_it_used(metered: Metered) -> None:
    burn = "python3 -c 'import time; t = time.process_time()\nwhile time.process_time() - t < 0.5: pass'; "
    async with as_caller(metered, "alice") as alice:
        started = await call(alice, "execute_command", command=burn + "exec python3 -m http.server 8000",
                             service={"name": "web", "port": 8000})  # fmt: skip
        assert not started["is_error"] and started["service"]["state"] == "running", started["text"]
    # The session ended, and its service with it.
    with anyio.fail_after(30):
        while not (stopped := [r for r in audit_of(metered) if r.get("event") == "service_stopped"]):
            await anyio.sleep(0.1)
    usage = stopped[0]["usage"]
    assert stopped[0]["caller"] == "alice" and usage["wall_s"] > 0, stopped[0]
    assert 0.45 <= usage["cpu_s"] <= usage["wall_s"] and usage["peak_memory_bytes"] > 0, usage
    totals = json.loads(run_cli("usage", "--audit-log", str(metered.audit), "--json").stdout)["totals"]
    assert totals["alice"]["service_s"] == round(usage["wall_s"], 3)
    assert totals["alice"]["service_cpu_s"] == round(usage["cpu_s"], 3)


async def test_metrics_need_their_own_token(metered: Metered) -> None:
    url = metered.server.url.removesuffix("/mcp") + "/metrics"
    async with httpx2.AsyncClient(timeout=10) as http:
        for headers in ({}, {"Authorization": f"Bearer {metered.tokens['alice']}"}):  # a caller's token is not it
            refused = await http.get(url, headers=headers)
            assert refused.status_code == 401 and "metrics token" in refused.text
        answer = await http.get(url, headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert answer.status_code == 200 and "sandbox_calls_total" in answer.text


async def test_what_each_callers_workspaces_and_snapshots_take_is_a_gauge(metered: Metered) -> None:
    async with as_caller(metered, "bob") as bob:
        await call(bob, "execute_command", command="head -c 2M /dev/urandom > kept.bin")
        taken = await call(bob, "workspaces", action="snapshot", name="meters")
    # The session ended: its workspace went with it, the snapshot stays until it is deleted or expires.
    url = metered.server.url.removesuffix("/mcp") + "/metrics"
    async with httpx2.AsyncClient(timeout=10) as http:
        scraped = (await http.get(url, headers={"Authorization": f"Bearer {METRICS_TOKEN}"})).text
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in scraped.splitlines()
        if line.startswith("sandbox_workspace")
    }
    assert not taken["is_error"], taken["text"]
    assert values['sandbox_workspaces{caller="bob",kind="snapshot"}'] == 1, values
    assert values['sandbox_workspace_bytes{caller="bob",kind="snapshot"}'] >= 2 * 2**20, values
    assert 'sandbox_workspaces{caller="bob",kind="workspace"}' not in values, values


def test_without_a_metrics_token_there_is_no_metrics_route(runtime: DockerRuntime, tmp_path: Path) -> None:
    with http_server_process("--no-pool", env={"SANDBOX_STATE_DIR": str(tmp_path)}) as server:
        answer = httpx2.get(server.url.removesuffix("/mcp") + "/metrics", timeout=10)
    assert answer.status_code == 404


@contextmanager
def prometheus(folder: Path, target: str) -> Iterator[str]:
    """Debian's Prometheus scraping `target` (this machine's loopback) every second with the metrics token; yields
    the URL of its query API."""
    port = free_port()
    credentials, config = folder / "credentials", folder / "prometheus.yml"
    credentials.write_text(METRICS_TOKEN)
    scrape = {
        "job_name": "sandbox-server",
        "authorization": {"type": "Bearer", "credentials_file": str(credentials)},
        "static_configs": [{"targets": [target]}],
    }
    config.write_text(
        json.dumps({"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": [scrape]})
    )
    binary = shutil.which("prometheus")
    assert binary is not None, "Prometheus is missing: `scripts/run test` installs Debian's"
    command = [binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
               f"--web.listen-address=127.0.0.1:{port}"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
            try:
                if httpx2.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            assert time.monotonic() < deadline, "Prometheus was not ready within 60 s"
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        if process.stderr is not None:
            process.stderr.close()


async def query(url: str, promql: str) -> float | None:
    async with httpx2.AsyncClient(timeout=10) as http:
        answer = (await http.get(f"{url}/api/v1/query", params={"query": promql})).json()
    assert answer["status"] == "success", answer
    found = answer["data"]["result"]
    return float(found[0]["value"][1]) if found else None


async def test_prometheus_scrapes_each_callers_calls_and_cpu_seconds(metered: Metered, tmp_path: Path) -> None:
    async with as_caller(metered, "alice") as alice:
        await call(alice, "execute_command", command="true")
    theirs = [r for r in audit_of(metered) if r.get("caller") == "alice" and "event" not in r]
    target = metered.server.url.removeprefix("http://").removesuffix("/mcp")
    with prometheus(tmp_path, target) as url:
        calls = None
        with anyio.fail_after(60):
            while calls != len(theirs):  # until a scrape after the calls above is in
                calls = await query(url, 'sum(sandbox_calls_total{caller="alice"})')
                await anyio.sleep(0.2)
        cpu = await query(url, 'sum(sandbox_call_cpu_seconds_total{caller="alice"})')
        ok = await query(url, 'sum(sandbox_calls_total{caller="alice", outcome="ok"})')
        service = await query(url, 'sum(sandbox_service_cpu_seconds_total{caller="alice"})')
    assert cpu == pytest.approx(sum(r["usage"]["cpu_s"] or 0 for r in theirs), abs=1e-6)
    assert cpu is not None and cpu >= 0.75  # the burn of the first test is in it
    assert ok == sum(r["outcome"] == "ok" for r in theirs)
    stopped = [r for r in audit_of(metered) if r.get("event") == "service_stopped" and r["caller"] == "alice"]
    assert service is not None and service > 0
    assert service == pytest.approx(sum(r["usage"]["cpu_s"] for r in stopped), abs=1e-6)
