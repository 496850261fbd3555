"""`sandbox-server serve`: the engine connection, policy, pool, watcher and transport, wired and run."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import anyio
import anyio.to_thread

from sandbox_server.errors import SandboxServerError, UsageError
from sandbox_server.ops.bootstrap import host_facts

if TYPE_CHECKING:
    from starlette.routing import Route

    from sandbox_server.access.auth import Authentication
    from sandbox_server.access.shared import SharedAccess
    from sandbox_server.policy import Policy
    from sandbox_server.protocol.server import SandboxServer
    from sandbox_server.sandbox.docker_runtime import DockerRuntime
    from sandbox_server.state.database import Database
    from sandbox_server.workspaces.contents import Contents

__all__ = ["serve_command"]

WORKSPACE_SWEEP_S = 60.0
"""How often expired workspaces are looked for while serving."""
RESTART_S = 1.0
"""How long a task beside the transport that failed with an OSError waits before it starts again."""


def serve_command(args: argparse.Namespace) -> int:
    """`sandbox-server serve`: run the server until the client leaves or a signal comes."""
    from sandbox_server.access.audit import AuditLog
    from sandbox_server.network.proxies import EgressProxies
    from sandbox_server.ops.memory import return_freed_memory
    from sandbox_server.policy.loader import load_policy
    from sandbox_server.policy.watcher import watch_policy
    from sandbox_server.protocol.health import health_route
    from sandbox_server.protocol.http_limits import ConnectionLimits, raise_open_files_limit
    from sandbox_server.protocol.preview import Previews, serve_previews
    from sandbox_server.protocol.server import SandboxServer
    from sandbox_server.protocol.transports import (
        LOOPBACK_HOSTS,
        allowed_hosts,
        host_names,
        listen,
        serve_http,
        serve_stdio,
        url_of,
    )
    from sandbox_server.sandbox import netns
    from sandbox_server.sandbox.docker_runtime import DockerRuntime
    from sandbox_server.sandbox.pool import WarmPool
    from sandbox_server.sandbox.removal import owner_alive
    from sandbox_server.services.manager import Services
    from sandbox_server.state.folder import claim_state_folder
    from sandbox_server.tasks.manager import Tasks
    from sandbox_server.tools import all_tools
    from sandbox_server.workspaces.store import WorkspaceStore, default_state_dir

    if args.transport == "http" and args.host not in LOOPBACK_HOSTS and not args.tokens and not args.issuer:
        raise UsageError(
            f"serve --transport http --host {args.host}: anyone who reaches that address could run code, so "
            "the server does not start without authentication. Make a token for each caller with "
            "`sandbox-server token add NAME --policy POLICY --tokens FILE` and serve with `--tokens FILE`, "
            "or accept an OAuth authorization server's tokens with `--issuer URL`, "
            "or bind to loopback (--host 127.0.0.1)"
        )
    if (args.tokens or args.issuer) and args.transport != "http":
        raise UsageError("--tokens and --issuer authenticate HTTP callers; over stdio the caller is the local user")
    issuer_options = args.jwks_url or args.scope_policy or args.claim_policy or args.required_scope
    if issuer_options and not args.issuer:
        raise UsageError("--jwks-url, --scope-policy, --claim-policy and --required-scope need --issuer URL")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="sandbox-server: %(message)s")
    log = logging.getLogger("sandbox_server")
    raise_open_files_limit()  # bounded by the caps on connections, walks and sessions, never by hope
    return_freed_memory()  # what a burst of large calls held goes back to the host once they are answered
    listener = listen(args.host, args.port) if args.transport == "http" else None  # a taken port is said first
    runtime = DockerRuntime.lazy()
    _start_reaper(runtime.owner)
    database = _shared_state(args, runtime.owner, log)

    def alive(owner: str) -> bool:
        """Whether a server process (a replica, with shared state) still runs; a database that does not answer
        tells nothing, and nothing is taken for dead on its silence."""
        if not owner_alive(owner):
            return False
        try:
            return database is None or database.alive(owner)
        except SandboxServerError:
            return True

    tools = all_tools()
    names = [tool.name for tool in tools]
    policy = load_policy(args.policy, names, host_facts(runtime))
    try:
        reaped = runtime.reap_strays()
        if reaped:
            log.info("removed %d stray sandbox container(s)", reaped)
    except SandboxServerError as exc:
        log.warning("%s", exc)
    audit_path = args.audit_log or policy.audit.path
    replica = runtime.owner if database is not None else None
    audit = AuditLog(audit_path, policy.audit.max_bytes, policy.audit.keep, replica) if audit_path else None
    pool = None if args.no_pool else WarmPool(runtime, runtime.activity)
    chosen = bool(args.state_dir) or bool(os.environ.get("SANDBOX_STATE_DIR"))
    held = claim_state_folder(Path(args.state_dir) if args.state_dir else default_state_dir(), chosen)
    state_dir = held.path  # this server's alone while it runs: the lock goes with the process
    if held.shared_with is not None:
        log.info(
            "the state folder %s is another server's (process %s): this one keeps its state in %s",
            state_dir.parent.parent, held.shared_with or "unknown", state_dir,
        )  # fmt: skip
    if database is None:
        contents, book = _workspace_contents(args.workspaces, runtime, log), None
    else:
        from sandbox_server.workspaces.shared import SharedArchives, SharedBook

        if args.workspaces == "mounted":
            raise UsageError("--workspaces mounted keeps workspaces on one host; with --state they are archives")
        book = SharedBook(database)
        contents = functools.partial(SharedArchives, book=book)
        log.info("workspaces are kept as archives in the shared state, continued on any replica")
    workspaces = WorkspaceStore(
        state_dir / "workspaces", policy.workspace, policy.host.workspace_storage_mb * 1024 * 1024, contents, book
    )
    if database is not None:
        workspaces.replica_alive = alive
    swept = workspaces.sweep(alive)
    if swept:
        log.info("removed %d expired or orphaned workspace(s)", swept)
    proxies = EgressProxies(lambda: runtime.api, runtime.owner, runtime.on_this_host)
    proxies.sweep_firewall()  # the rules of proxies whose server was killed
    caller_policies: dict[str, Policy] = {}
    rows = None
    if database is not None:
        from sandbox_server.tasks.shared import TaskRows

        rows = TaskRows(database)
    tasks = Tasks(state_dir / "tasks", runtime.owner, audit, alive, rows)
    services = Services(runtime, workspaces, audit, proxies)

    def caller_policy(reference: str) -> Policy:
        """A token's policy, loaded once for this host (the server's own, with its reloads, when it names that)."""
        if reference == args.policy:
            return app.policy
        if reference not in caller_policies:
            caller_policies[reference] = load_policy(reference, names, host_facts(runtime))
        return caller_policies[reference]

    app = SandboxServer(
        tools, policy, runtime, page_size=args.page_size, audit=audit, pool=pool, tool_prefix=args.tool_prefix,
        workspaces=workspaces, instance=runtime.owner, proxies=proxies,
        caller_policy=caller_policy if args.tokens or args.issuer else None, tasks=tasks,
        services=services, shared=_shared_access(database),
    )  # fmt: skip
    authentication = _authentication(args, caller_policy, log, database)
    metrics = _metrics(args, app, log)
    stop_tracing = _tracing(args, app, runtime.owner, log)
    if authentication is not None:  # warm containers for every policy a caller may have, from the start
        app.know_policies(authentication.verifier.policies())

    async def sweep_workspaces() -> None:
        while True:
            await anyio.sleep(WORKSPACE_SWEEP_S)
            try:
                removed = await anyio.to_thread.run_sync(workspaces.sweep, alive)
            except SandboxServerError as exc:  # the shared state does not answer: swept at the next turn
                log.warning("workspace sweep: %s", exc)
                continue
            if removed:
                log.info("removed %d expired workspace(s)", removed)

    async def beat() -> None:
        """Replicas: say this one is alive, and forget those that stopped saying so."""
        assert database is not None
        while True:
            await anyio.sleep(database.beat_s)
            try:
                await anyio.to_thread.run_sync(database.check)
                await database.acheck()
                await anyio.to_thread.run_sync(database.beat)
                await anyio.to_thread.run_sync(database.forget_lost)
            except SandboxServerError as exc:
                log.warning("shared state: %s", exc)

    def engine_problem() -> str | None:
        try:
            runtime.api.ping()
        except Exception as exc:  # whatever the engine's client raises, the check says it
            return f"the engine does not answer ({exc})"
        return None

    checks = {"engine": engine_problem} | ({"state": database.problem} if database is not None else {})

    async def surviving(name: str, work: Callable[[], Awaitable[None]]) -> None:
        """Run a task beside the transport; an OSError (a full descriptor table, say) is logged, and the
        task starts again a second later, rather than ending the server."""
        while True:
            try:
                await work()
                return
            except OSError as exc:
                log.warning("%s failed (%s); it starts again in %g s", name, exc, RESTART_S)
                await anyio.sleep(RESTART_S)

    stopping = anyio.Event()
    preview_listener = None
    if args.preview_port is not None:
        if args.transport != "stdio":
            raise UsageError("--preview-port is for stdio; over HTTP previews are served beside /mcp")
        preview_listener = listen("127.0.0.1", args.preview_port)

    def offer_previews(base_url: str, host: str) -> Previews:
        """The preview routes; their links go into answers when this host lets the server reach services."""
        public = urlsplit(args.public_url).hostname if args.public_url else None
        previews = Previews(services, base_url, allowed_hosts(host_names(host, public)))
        why_not = netns.unavailable() or (None if runtime.on_this_host() else "the engine is elsewhere")
        if why_not is None:
            services.preview_of = previews.link
            log.info("services' previews at %s/preview/", base_url)
        else:
            log.info("services have no preview: %s (it reaches them from inside)", why_not)
        return previews

    async def stop_on_signal(scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            received = await signals.__anext__()
        # Stopping from now on: a second SIGTERM (a supervisor's, a client's grace period running out) would end
        # the process before it removed its containers and unmounted its workspaces. SIGKILL still ends it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        log.info("%s: shutting down", signal.Signals(received).name)
        if listener is None:
            scope.cancel()
        else:  # HTTP stops as uvicorn stops (its lifespan ended in order), then the rest is cancelled
            stopping.set()

    async def main() -> None:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(stop_on_signal, group.cancel_scope)
                await group.start(tasks.serve)  # before the first request: a task may be asked for at once
                await group.start(services.serve)
                await group.start(app.parked.serve)  # 2026-07-28 calls asking about hosts run beside their requests
                group.start_soon(surviving, "the workspace sweep", sweep_workspaces)
                if database is not None:
                    group.start_soon(surviving, "the replica's heartbeat", beat)
                if pool is not None:
                    group.start_soon(surviving, "the warm pool", pool.maintain)
                if not args.no_watch:

                    async def watch() -> None:
                        await watch_policy(
                            args.policy, Path(policy.source), names, lambda: host_facts(runtime), app.swap_policy
                        )

                    group.start_soon(surviving, "the policy watcher", watch)
                if listener is not None:
                    limits = ConnectionLimits.of(args)
                    log.info("serving MCP over Streamable HTTP at %s", url_of(listener))
                    previews = offer_previews((args.public_url or url_of(listener)).removesuffix("/mcp"), args.host)
                    await serve_http(
                        app, args.host, listener, authentication, limits, args.max_request_bytes, stopping,
                        [*previews.routes(), health_route(checks), *metrics],
                    )  # fmt: skip
                else:
                    if preview_listener is not None:
                        previews = offer_previews(url_of(preview_listener).removesuffix("/mcp"), "127.0.0.1")
                        group.start_soon(serve_previews, previews, preview_listener)
                    await serve_stdio(app)
                group.cancel_scope.cancel()
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping (stdin closed, say): as in stop_on_signal
            with anyio.CancelScope(shield=True):
                ended = workspaces.end_sessions(runtime.owner)
                if ended:
                    log.info("removed the workspace(s) of %d handshake session(s) that ended with the server", ended)
                async with anyio.create_task_group() as closing:  # the waiting and the used containers side by side
                    if pool is not None:
                        closing.start_soon(pool.close)
                    closing.start_soon(anyio.to_thread.run_sync, runtime.removal.close)
                await anyio.to_thread.run_sync(runtime.close_connection)
                await anyio.to_thread.run_sync(proxies.close)
                workspaces.close()
                if stop_tracing is not None:
                    await anyio.to_thread.run_sync(stop_tracing)  # the last spans go out
                if database is not None:
                    await database.aclose()
                    await anyio.to_thread.run_sync(database.close)

    anyio.run(main)
    return 0


def _authentication(
    args: argparse.Namespace, caller_policy: Callable[[str], Policy], log: logging.Logger, database: Database | None
) -> Authentication | None:
    """Who may call over HTTP: the tokens file's callers and the issuer's (None: no authentication)."""
    from sandbox_server.access.auth import Authentication, JwtVerifier, PolicyRule, StaticTokenVerifier, jwks_url_of
    from sandbox_server.access.tokens import TokensFile
    from sandbox_server.policy.loader import policy_problem

    if not args.tokens and not args.issuer:
        return None
    resource = args.public_url or f"http://{args.host}:{args.port}/mcp"
    static, issued = None, None
    problem_of = policy_problem(caller_policy)  # a policy is checked by loading it as its caller's calls will
    if args.tokens:
        tokens_file = TokensFile(Path(args.tokens), problem_of)
        tokens: TokensFile | SharedTokens = tokens_file
        if database is not None:  # replicas: the callers are the shared state's (the file seeds them once)
            from sandbox_server.access.shared import SharedTokens

            tokens = SharedTokens(database, seed=tokens_file)
        static = StaticTokenVerifier(tokens)
        where = "the shared state" if database is not None else args.tokens
        log.info("HTTP callers need a token of %s (%d caller(s))", where, len(tokens.callers()))
    if args.issuer:
        rules = [PolicyRule.parse(rule, by_scope=True) for rule in args.scope_policy]
        rules += [PolicyRule.parse(rule, by_scope=False) for rule in args.claim_policy]
        for rule in rules:
            problem = problem_of(rule.policy)
            if problem is not None:
                raise UsageError(f"policy {rule.policy!r} of rule {rule.claim}:{rule.value}: {problem}")
        jwks = args.jwks_url or jwks_url_of(args.issuer)
        issued = JwtVerifier(args.issuer, resource, jwks, rules)
        log.info("HTTP callers may bring JWT access tokens of %s for %s (keys: %s)", args.issuer, resource, jwks)
    return Authentication.of(resource, static, issued, args.required_scope)


def _shared_state(args: argparse.Namespace, owner: str, log: logging.Logger) -> Database | None:
    """The shared state's database (serve --state, SANDBOX_STATE_URL), connected and migrated; None without."""
    import os

    url = args.state or os.environ.get("SANDBOX_STATE_URL")
    if not url:
        return None
    if not url.startswith(("postgresql://", "postgres://")):
        raise UsageError(f"--state {url!r}: give a PostgreSQL URL, postgresql://user[:password]@host[:port]/database")
    try:
        from sandbox_server.state.database import Database, shown_url
    except ImportError as exc:
        raise UsageError(
            f"--state needs the PostgreSQL driver ({exc.name} is missing): pip install 'sandbox-server[postgresql]'"
        ) from exc
    database = Database(url, owner)
    database.open()
    log.info("shared state: %s (replica %s)", shown_url(url), owner)
    return database


def _metrics(args: argparse.Namespace, app: SandboxServer, log: logging.Logger) -> list[Route]:
    """The /metrics route (serve --metrics-token-file), and every call counted for it; none without."""
    if not args.metrics_token_file:
        return []
    if args.transport != "http":
        raise UsageError("--metrics-token-file serves /metrics over HTTP (--transport http)")
    try:
        token = Path(args.metrics_token_file).read_text().strip()
    except OSError as exc:
        raise UsageError(f"--metrics-token-file {args.metrics_token_file}: {exc.strerror}") from None
    if len(token) < 16 or not token.isprintable() or " " in token:
        raise UsageError(f"--metrics-token-file {args.metrics_token_file}: the token must be one word of 16 or more")
    from sandbox_server.calls.meters import Meters
    from sandbox_server.protocol.metrics import metrics_route

    app.calls.meters = Meters()
    if app.calls.services is not None:
        app.calls.services.observe = app.calls.meters.observe
    log.info("meters for Prometheus at /metrics, for a bearer of the metrics token")
    return [metrics_route(app.calls.meters, token)]


def _tracing(
    args: argparse.Namespace, app: SandboxServer, owner: str, log: logging.Logger
) -> Callable[[], None] | None:
    """Spans of each call over OTLP (serve --otlp-endpoint, OTEL_EXPORTER_OTLP_ENDPOINT); how to flush them at
    the end, or None without."""
    from sandbox_server.calls.tracing import otlp_tracing

    try:
        made = otlp_tracing(args.otlp_endpoint, owner)
    except ImportError as exc:
        raise UsageError(
            f"--otlp-endpoint needs OpenTelemetry ({exc.name} is missing): pip install 'sandbox-server[telemetry]'"
        ) from exc
    if made is None:
        return None
    app.calls.tracing, stop = made
    log.info("spans of each call over OTLP to %s", args.otlp_endpoint or "the collector OTEL_EXPORTER_OTLP_* names")
    return stop


def _shared_access(database: Database | None) -> SharedAccess | None:
    if database is None:
        return None
    from sandbox_server.access.shared import SharedAccess

    return SharedAccess.of(database)


def _workspace_contents(choice: str, runtime: DockerRuntime, log: logging.Logger) -> Callable[[Path], Contents]:
    """How this server keeps workspace files (serve --workspaces), said once at start."""
    from sandbox_server.sandbox import mounts
    from sandbox_server.sandbox.removal import owner_alive
    from sandbox_server.workspaces.contents import ArchivedContents
    from sandbox_server.workspaces.mounted import MountedContents

    why_not = None if choice == "archived" else mounts.unavailable(runtime.on_this_host())
    if choice == "mounted" and why_not is not None:
        raise SandboxServerError(f"--workspaces mounted: kept workspaces cannot be mounted here: {why_not}")
    if choice == "archived" or why_not is not None:
        reason = "as asked" if choice == "archived" else f"{why_not}, so they cannot be mounted"
        log.info("workspaces are kept as archives carried in and out of each call (%s)", reason)
        return ArchivedContents
    log.info("workspaces are kept as sized filesystems mounted into each call's container")
    return lambda root: MountedContents(root, runtime.owner, owner_alive, runtime.activity)


def _start_reaper(owner: str) -> None:
    """A small process that outlives this one: if this server is killed, it removes the server's containers."""
    import os
    import subprocess

    subprocess.Popen(
        [sys.executable, "-m", "sandbox_server", "reap-after", "--pid", str(os.getpid()), "--owner", owner],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the server's process group, so a signal to the group spares it
        close_fds=True,
    )
