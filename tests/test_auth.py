"""Who is calling over HTTP: static tokens, a policy per caller, refusals that say why.

The real server over Streamable HTTP, the official MCP client carrying each caller's
token, the real engine; tokens made by the real `sandbox-server token` commands.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import docker
import docker.errors
import httpx2
import jwt
import mcp_types as types
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from sandbox_server.policy.loader import load_policy
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.runc.runtime import RuncRuntime
from sandbox_server.sandbox.runc.state import STATE, is_gvisor
from sandbox_server.sandbox.spec import SandboxSpec
from sandbox_server.tools import all_tools
from tests.conftest import containers_of, run_cli
from tests.mcp_harness import (
    CheckedClient,
    ServerProcess,
    answer,
    audit_records,
    connect,
    first_runc_sandboxes,
    first_sandboxes,
    free_port,
    http_server_process,
    text_of,
)

pytestmark = pytest.mark.anyio


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox_server", *args], capture_output=True, text=True, timeout=60)


def add_token(tokens: Path, name: str, policy: str) -> str:
    done = cli("token", "add", name, "--policy", policy, "--tokens", str(tokens))
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1]  # alone on the last line


def test_http_on_an_address_other_than_loopback_does_not_start_without_authentication() -> None:
    done = cli("serve", "--transport", "http", "--host", "0.0.0.0", "--port", str(free_port()))
    assert done.returncode == 2
    assert "does not start without authentication" in done.stderr, done.stderr
    assert (
        "sandbox-server token add NAME --policy POLICY --tokens FILE" in done.stderr and "--tokens FILE" in done.stderr
    )


def test_token_add_prints_the_token_once_and_keeps_only_its_hash(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    token = add_token(tokens, "alice", "default")
    assert token.startswith("sbx_") and len(token) > 40
    stored = tokens.read_text()
    assert token not in stored and json.loads(stored)["tokens"][0]["name"] == "alice"
    assert tokens.stat().st_mode & 0o777 == 0o600
    again = cli("token", "add", "alice", "--tokens", str(tokens))
    assert again.returncode == 1 and "a caller named 'alice' exists" in again.stderr
    unknown_policy = cli("token", "add", "carol", "--policy", "no-such-policy", "--tokens", str(tokens))
    assert unknown_policy.returncode == 1 and "--policy" in unknown_policy.stderr
    unnamed = cli("token", "add", "erin", "--tokens", str(tokens))  # no --policy: said, whatever the server's
    assert unnamed.returncode == 0 and "no --policy: this caller's calls run under policy 'default'" in unnamed.stderr
    assert cli("token", "revoke", "erin", "--tokens", str(tokens)).returncode == 0
    listed = cli("token", "list", "--tokens", str(tokens))
    assert listed.stdout.startswith("alice\tpolicy default\tadded ") and token not in listed.stdout
    assert cli("token", "revoke", "alice", "--tokens", str(tokens)).returncode == 0
    assert json.loads(tokens.read_text()) == {"tokens": []}


def test_a_policy_file_named_by_a_relative_path_is_kept_by_its_absolute_one(tmp_path: Path) -> None:
    (tmp_path / "pol").mkdir()
    (tmp_path / "pol" / "mine.yaml").write_text("extends: default\n")
    tokens = tmp_path / "tokens.json"
    added = run_cli("token", "add", "alice", "--policy", "pol/mine.yaml", "--tokens", str(tokens), cwd=tmp_path)
    assert added.returncode == 0, added.stderr
    [entry] = json.loads(tokens.read_text())["tokens"]
    assert entry["policy"] == str(tmp_path / "pol" / "mine.yaml"), entry  # a server started elsewhere finds it
    named = run_cli("token", "add", "bob", "--policy", "strict", "--tokens", str(tokens))
    assert named.returncode == 0 and json.loads(tokens.read_text())["tokens"][1]["policy"] == "strict"


@dataclass
class Team:
    server: ServerProcess
    tokens: Path
    audit: Path
    alice: str
    bob: str
    dave: str


@pytest.fixture(scope="module")
def team(runtime: DockerRuntime, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Team]:
    folder = tmp_path_factory.mktemp("team")
    tokens, audit = folder / "tokens.json", folder / "audit.jsonl"
    alice, bob = add_token(tokens, "alice", "default"), add_token(tokens, "bob", "strict")
    dave = add_token(tokens, "dave", "default")  # under alice's policy, so workspaces are kept for both
    state = folder / "state"
    with http_server_process(
        "--tokens", str(tokens), "--audit-log", str(audit), "--no-pool", env={"SANDBOX_STATE_DIR": str(state)}
    ) as server:
        yield Team(server, tokens, audit, alice, bob, dave)


@asynccontextmanager
async def as_caller(team: Team, token: str, mode: str = "legacy") -> AsyncIterator[CheckedClient]:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=300)) as http:
        async with connect(streamable_http_client(team.server.url, http_client=http), mode=mode) as client:
            yield client


async def call(client: CheckedClient, tool: str, **arguments: Any) -> dict[str, Any]:
    return await answer(client, tool, arguments)


async def test_a_request_without_a_valid_token_gets_a_401_saying_why_and_where_the_metadata_is(team: Team) -> None:
    metadata = team.server.url.replace("/mcp", "/.well-known/oauth-protected-resource/mcp")
    # 30 s, not httpx's 5: the server answers at once, but a loaded host (workers side by side) can stall it
    async with httpx2.AsyncClient(timeout=30) as http:
        cases = {
            "no bearer token": {},
            "malformed Authorization header": {"Authorization": "Basic YWxpY2U6eA=="},
            "the token is not known here": {"Authorization": "Bearer sbx_made-up"},
        }
        for reason, headers in cases.items():
            answer = await http.post(team.server.url, headers=headers, json={})
            assert answer.status_code == 401
            challenge = answer.headers["www-authenticate"]
            assert challenge.startswith("Bearer ") and f'error_description="{reason}' in challenge, challenge
            assert f'resource_metadata="{metadata}"' in challenge
            body = answer.json()  # and as a JSON-RPC error, which clients show as the request's error
            assert body["error"]["code"] == -32001 and reason in body["error"]["message"], body
            assert (
                body["error"]["data"]["error"] == "invalid_token"
                and answer.headers["content-type"] == "application/json"
            )
        described = (await http.get(metadata)).json()
    assert described["resource"] == team.server.url and described["bearer_methods_supported"] == ["header"]
    team.server.wait_for_line("refused an HTTP request from 127.0.0.1: the token is not known here")
    assert not any("sbx_made-up" in line or "YWxpY2U6eA" in line for line in team.server.lines)


def test_the_server_says_at_its_start_which_policies_its_callers_tokens_name(team: Team) -> None:
    team.server.wait_for_line("callers' policy default: 2 caller(s) (alice, dave)", timeout_s=60)
    team.server.wait_for_line("callers' policy strict: 1 caller(s) (bob)")
    team.server.wait_for_line("1 caller(s) run under another policy than this server's default, as their tokens name")


async def test_each_callers_calls_run_under_the_policy_of_its_token_and_the_audit_names_them(team: Team) -> None:
    async with as_caller(team, team.alice) as alice, as_caller(team, team.bob) as bob:
        # A cold interpreter under gVisor takes most of strict's 10 s on a busy 2-core host: 20 s (its most).
        alices = await call(alice, "run_python", code="import os\nos.getuid()", timeout_s=20)
        bobs = await call(bob, "run_python", code="import os\nos.getuid()", timeout_s=20)
        shell = await call(bob, "execute_command", command="id")
    assert alices["stdout"] == "1000\n", alices["text"]  # default
    assert bobs["stdout"] == "65534\n", bobs["text"]  # strict
    assert shell["is_error"] and "policy 'strict' does not allow a shell (field commands.shell)" in shell["text"]
    records = audit_records(team.audit)
    assert [(r["caller"], r["policy"]) for r in records[-3:]] == [
        ("alice", "default"),
        ("bob", "strict"),
        ("bob", "strict"),
    ]
    audit_text = team.audit.read_text()
    assert team.alice not in audit_text and team.bob not in audit_text


async def test_a_revoked_token_fails_at_once_and_a_broken_tokens_file_keeps_the_last_good_one(team: Team) -> None:
    carol = add_token(team.tokens, "carol", "default")
    async with as_caller(team, carol) as client:
        assert (await call(client, "run_python", code="1 + 1"))["stdout"] == "2\n"
        assert cli("token", "revoke", "carol", "--tokens", str(team.tokens)).returncode == 0
        logged = len(team.server.lines)
        with pytest.raises(MCPError) as refused:  # the session's very next request, the reason in what it shows
            await client.call_tool("run_python", {"code": "1 + 1"})
        assert refused.value.error.code == -32001, refused.value.error
        assert "unauthorized (HTTP 401): the token is not known here: revoked" in str(refused.value), refused.value
        team.server.wait_for_line("refused an HTTP request from 127.0.0.1: the token is not known here", after=logged)
    good = team.tokens.read_text()
    team.tokens.write_text(good.replace('"policy": "default"', '"policy": 7', 1))
    try:
        async with as_caller(team, team.alice) as alice:
            assert (await call(alice, "run_python", code="2 + 2"))["stdout"] == "4\n"
        line = team.server.wait_for_line("tokens[0].policy: expected a shipped policy name or a policy file")
        assert carol not in line and team.alice not in line
        team.server.wait_for_line("the previous tokens stay in force")
    finally:
        team.tokens.write_text(good)
        os.chmod(team.tokens, 0o600)


async def test_a_callers_workspaces_and_files_are_unknown_to_every_other_caller(team: Team) -> None:
    big = "head -c 100000 /dev/zero | tr '\\0' a > out/big.txt; echo kept > note.txt"
    async with as_caller(team, team.alice, mode="2026-07-28") as alice:
        result = await alice.call_tool("execute_command", {"command": big})
        workspace = result.structured_content["workspace"] if result.structured_content else None
        link = next(b for b in result.content if isinstance(b, types.ResourceLink))
        kept_file = f"sandbox://workspace/{workspace}/note.txt"
        assert (await alice.read_resource(str(link.uri))).contents[0].text == "a" * 100_000  # type: ignore[union-attr]
        assert (await alice.read_resource(kept_file)).contents[0].text == "kept\n"  # type: ignore[union-attr]
        continued = await call(alice, "execute_command", command="cat note.txt", workspace=workspace)
        assert continued["stdout"] == "kept\n", continued["text"]
    made_up = "ws-" + "B" * 22
    # dave has alice's policy (workspaces kept), bob has strict (none kept)
    for token, mode in [(t, m) for t in (team.dave, team.bob) for m in ("2026-07-28", "legacy")]:
        async with as_caller(team, token, mode=mode) as other:
            # (a program both policies allow: a call the policy refuses on its own is refused before its workspace)
            foreign = await call(other, "execute_command", command="cat", args=["note.txt"], workspace=workspace)
            unknown = await call(other, "execute_command", command="cat", args=["note.txt"], workspace=made_up)
            listed = [str(r.uri) for r in (await other.list_resources()).resources]
            refusals = []
            for uri in (str(link.uri), kept_file, str(link.uri).replace("big.txt", "other.txt")):
                with pytest.raises(MCPError) as refused:
                    await other.read_resource(uri)
                refusals.append((refused.value.error.code, refused.value.error.message.replace(uri, "URI")))
        assert foreign["is_error"] and foreign["error"]["field"] == "workspace"
        assert foreign["text"].replace(str(workspace), made_up) == unknown["text"]  # refused like one that never was
        assert str(link.uri) not in listed and kept_file not in listed
        assert refusals[0] == refusals[1] == refusals[2]  # alike to a URI nobody has


# -- OAuth: JWT access tokens of the test's own authorization server ------------------------


@dataclass
class Issuer:
    """The test's own authorization server: its metadata and key set, served on loopback."""

    url: str
    key: rsa.RSAPrivateKey
    kid: str = "test-key-1"

    def token(
        self, audience: str, lifetime_s: int = 300, key: Any = None, kid: str | None = None, **claims: Any
    ) -> str:
        now = int(time.time())
        payload = {"iss": self.url, "aud": audience, "sub": "alice@example.org", "iat": now, "exp": now + lifetime_s}
        return jwt.encode({**payload, **claims}, key or self.key, "RS256", headers={"kid": kid or self.kid})


@pytest.fixture(scope="module")
def issuer() -> Iterator[Issuer]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    served = Issuer("", key)
    public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            documents = {
                "/.well-known/oauth-authorization-server": {
                    "issuer": served.url,
                    "authorization_endpoint": served.url + "/authorize",
                    "token_endpoint": served.url + "/token",
                    "response_types_supported": ["code"],
                    "jwks_uri": served.url + "/jwks.json",
                },
                "/jwks.json": {"keys": [{**public, "kid": served.kid, "use": "sig", "alg": "RS256"}]},
            }
            body = json.dumps(documents[self.path]).encode() if self.path in documents else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler) as httpd:
        served.url = f"http://127.0.0.1:{httpd.server_address[1]}"
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        try:
            yield served
        finally:
            httpd.shutdown()
            thread.join()


@dataclass
class OAuthServer:
    server: ServerProcess
    audit: Path
    issuer: Issuer


@pytest.fixture(scope="module")
def oauth(runtime: DockerRuntime, issuer: Issuer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OAuthServer]:
    audit = tmp_path_factory.mktemp("oauth") / "audit.jsonl"
    rules = ["--scope-policy", "sandbox:strict=strict", "--claim-policy", "groups:auditors=strict"]
    with http_server_process(
        "--issuer", issuer.url, *rules, "--required-scope", "sandbox", "--audit-log", str(audit), "--no-pool"
    ) as server:
        yield OAuthServer(server, audit, issuer)


async def test_a_jwt_of_the_issuer_runs_under_the_policy_its_scope_or_claim_picks(oauth: OAuthServer) -> None:
    audience, issuer = oauth.server.url, oauth.issuer
    plain = issuer.token(audience, scope="sandbox")
    by_scope = issuer.token(audience, scope="sandbox sandbox:strict", sub="bob@example.org")
    by_claim = issuer.token(audience, scope="sandbox", groups=["staff", "auditors"], sub="carol@example.org")
    uids = []
    for token in (plain, by_scope, by_claim):
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
            async with connect(streamable_http_client(oauth.server.url, http_client=http)) as client:
                cell = await call(client, "run_python", code="import os\nos.getuid()", timeout_s=20)  # as above
                uids.append(cell["stdout"])
    assert uids == ["1000\n", "65534\n", "65534\n"]  # default (the server's), strict, strict
    records = audit_records(oauth.audit)
    assert [(r["caller"], r["policy"]) for r in records[-3:]] == [
        ("alice@example.org", "default"),
        ("bob@example.org", "strict"),
        ("carol@example.org", "strict"),
    ]
    async with httpx2.AsyncClient(timeout=30) as http:
        described = (await http.get(audience.replace("/mcp", "/.well-known/oauth-protected-resource/mcp"))).json()
    assert described["authorization_servers"] == [issuer.url] and described["resource"] == audience


async def test_expired_foreign_and_misaddressed_jwts_get_a_401_saying_why(oauth: OAuthServer) -> None:
    audience, issuer = oauth.server.url, oauth.issuer
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    cases = {
        "the token has expired": issuer.token(audience, lifetime_s=-3600, scope="sandbox"),
        "the token is for another audience": issuer.token("http://127.0.0.1:1/mcp", scope="sandbox"),
        "the token's signature does not verify": issuer.token(audience, key=stranger, scope="sandbox"),
        "the token's signing key (kid 'other-key') is not one of the issuer's": issuer.token(
            audience, key=stranger, kid="other-key", scope="sandbox"
        ),
        "the token was issued by another issuer": issuer.token(audience, scope="sandbox", iss="http://127.0.0.1:2"),
        "the token is signed with 'HS256'": jwt.encode({"sub": "x", "aud": audience}, "secret" * 6, "HS256"),
        "malformed token": "not-a-jwt",
    }
    async with httpx2.AsyncClient(timeout=30) as http:
        for reason, token in cases.items():
            answer = await http.post(audience, headers={"Authorization": f"Bearer {token}"}, json={})
            challenge = answer.headers.get("www-authenticate", "")
            assert answer.status_code == 401 and f'error_description="{reason}' in challenge, (reason, challenge)
            assert "resource_metadata=" in challenge
            line = oauth.server.wait_for_line(f"refused an HTTP request from 127.0.0.1: {reason}")
            assert token not in line
        unscoped = await http.post(audience, headers={"Authorization": f"Bearer {issuer.token(audience)}"}, json={})
    assert unscoped.status_code == 403 and 'error="insufficient_scope"' in unscoped.headers["www-authenticate"]


def test_serve_refuses_issuer_options_it_cannot_use(issuer: Issuer) -> None:
    port = str(free_port())
    alone = cli("serve", "--transport", "http", "--port", port, "--scope-policy", "a=strict")
    assert alone.returncode == 2 and "need --issuer URL" in alone.stderr
    malformed = cli("serve", "--transport", "http", "--port", port, "--issuer", issuer.url, "--claim-policy", "x")
    assert malformed.returncode == 2 and "expected CLAIM:VALUE=POLICY" in malformed.stderr
    nowhere = cli("serve", "--transport", "http", "--port", port, "--issuer", issuer.url + "/nowhere")
    assert nowhere.returncode == 2 and "no usable authorization server metadata" in nowhere.stderr
    assert "--jwks-url" in nowhere.stderr


async def test_callers_of_another_policy_are_served_by_warm_containers_of_theirs(
    runtime: RuncRuntime, tmp_path: Path
) -> None:
    tokens, audit = tmp_path / "tokens.json", tmp_path / "audit.jsonl"
    bob = add_token(tokens, "bob", "strict")  # the server's own policy is default; bob's is gVisor's
    with http_server_process("--tokens", str(tokens), "--audit-log", str(audit)) as server:
        api = docker.from_env().api
        try:
            with anyio.fail_after(60):
                by_runsc = runtime.takes(SandboxSpec(image="i", argv=("true",), runtime="runsc"))  # as the server's
                made = functools.partial(_warm_gvisor_containers, api, server.process.pid, by_runsc)
                waiting = await anyio.to_thread.run_sync(made, abandon_on_cancel=True)
        finally:
            api.close()
        team = Team(server, tokens, audit, "", bob, "")
        async with as_caller(team, bob) as client:
            answer = await call(client, "execute_command", command="id", args=["-u"])
    assert answer["stdout"] == "65534\n", answer["text"]
    record = audit_records(audit)[-1]
    assert record["runtime"] == "runsc" and record["container_id"] in waiting


def _warm_gvisor_containers(api: docker.APIClient, pid: int, by_runsc: bool) -> set[str]:
    """The sandboxes under gVisor the server `pid` made, waiting now, once there is one for execute_command (a
    first call runs in the one the engine is making for its kind, if none waits yet: strict's run_python pool,
    which preloads, fills first). Other servers' are not counted: tests run side by side."""
    image = load_policy("strict", [t.name for t in all_tools()]).for_tool("execute_command").image
    unpacked_as = str(api.inspect_image(image)["Id"]).removeprefix("sha256:")[:24]  # its folder, for runsc's

    def waiting() -> set[str]:
        found, shell = set(), False
        for container in containers_of(pid, running=True):
            if is_gvisor(STATE, container):  # made by runsc itself: its bundle's root is the image's, unpacked
                with contextlib.suppress(OSError, ValueError, KeyError):
                    root = json.loads((STATE / "bundles" / container / "config.json").read_text())["root"]["path"]
                    found.add(container[:12])
                    shell = shell or unpacked_as in root
                continue
            try:
                inspected = api.inspect_container(container)
            except docker.errors.NotFound:  # gone, or one runc runs itself (never gVisor's)
                continue
            if inspected["HostConfig"]["Runtime"] == "runsc":
                found.add(container[:12])
                shell = shell or inspected["Config"]["Image"] == image
        return found if shell else set()

    if by_runsc:
        return first_runc_sandboxes(waiting)
    return first_sandboxes(api, waiting)


async def test_the_audit_trail_is_kept_by_default_names_each_workspace_and_an_attempt_on_anothers(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    tokens, state = tmp_path / "tokens.json", tmp_path / "state"
    alice, dave = add_token(tokens, "alice", "default"), add_token(tokens, "dave", "default")
    with http_server_process("--tokens", str(tokens), "--no-pool", "--state-dir", str(state)) as server:
        team = Team(server, tokens, state / "audit.jsonl", alice, "", dave)
        async with as_caller(team, alice, mode="2026-07-28") as first:
            made = await first.call_tool("execute_command", {"command": "echo mine > f"})
        workspace = (made.structured_content or {})["workspace"]
        async with as_caller(team, dave, mode="2026-07-28") as other:
            tried = await other.call_tool("execute_command", {"command": "cat f", "workspace": workspace})
    assert tried.is_error and "unknown workspace" in text_of(tried) and "another" not in text_of(tried)
    trail = state / "audit.jsonl"  # no --audit-log, no audit.path: the state folder's
    assert trail.stat().st_mode & 0o777 == 0o600
    records = audit_records(trail)
    [mine] = [r for r in records if r.get("caller") == "alice" and r.get("tool") == "execute_command"]
    [theirs] = [r for r in records if r.get("caller") == "dave" and r.get("tool") == "execute_command"]
    assert mine["workspace"] == workspace and mine["outcome"] == "ok", mine
    assert (theirs["outcome"], theirs["denied"], theirs["workspace"]) == (
        "refused",
        "workspace of another caller",
        workspace,
    ), theirs
