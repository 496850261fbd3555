"""`sandbox-server serve`: the options checked, the parts built (cli/wiring.py) and run beside the transport."""

from __future__ import annotations

import argparse
import datetime
import functools
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from sandbox_server.cli.stopping import STOPPING, StopAsked
from sandbox_server.errors import SandboxServerError, UsageError
from sandbox_server.ops.bootstrap import host_facts

if TYPE_CHECKING:
    import socket

    from sandbox_server.access.audit import AuditLog
    from sandbox_server.cli.wiring import Wired
    from sandbox_server.protocol.draining import Drain
    from sandbox_server.sandbox.engine.runtime import DockerRuntime
    from sandbox_server.state.database import Database

__all__ = ["serve_command"]

WORKSPACE_SWEEP_S = 60.0
"""How often expired workspaces are looked for while serving."""
RESTART_S = 1.0
"""How long a task beside the transport that failed with an OSError waits before it starts again."""


LOG_FORMAT = "sandbox-server: %(message)s"


def serve_command(args: argparse.Namespace) -> int:
    """`sandbox-server serve`: check the options, build the parts (cli/wiring.py), and run them beside the
    transport until the client leaves or a signal comes; then close them in order."""
    from sandbox_server.protocol.addresses import LOOPBACK_HOSTS
    from sandbox_server.sandbox.engine.removal import operator_labels

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
    if (args.preview_port is not None or args.no_preview) and args.transport != "stdio":
        raise UsageError("--preview-port and --no-preview are for stdio; over HTTP previews are served beside /mcp")
    if args.preview_port is not None and args.no_preview:
        raise UsageError("--preview-port opens a port for previews, --no-preview none: give one of them")
    operator_labels()  # a malformed SANDBOX_CONTAINER_LABELS is said before anything starts
    logging.basicConfig(level=logging.INFO, handlers=[_log_handler()])
    log = logging.getLogger("sandbox_server")
    # A signal before the event loop takes signals over (while the parts start) unwinds the start: each part
    # started is closed (its mounts, its containers), where the default action would leave them behind. Taken
    # before the port opens: a supervisor that saw the port open may stop the server at once.
    signal.signal(signal.SIGTERM, STOPPING.asked)
    try:
        return _start_and_serve(args, log)
    except StopAsked as stopped:
        log.info("%s while starting: stopped", stopped)
    return 0


class _Dated(logging.Formatter):
    """Each line dated as RFC 3339 says, in UTC to the millisecond (`2026-12-06T20:40:12.345Z sandbox-server: …`),
    as sshd's and dockerd's lines are."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _log_handler() -> logging.Handler:
    """The server's log on stderr: dated, unless journald reads it (JOURNAL_STREAM names stderr), which dates each
    line itself."""
    handler = logging.StreamHandler(sys.stderr)
    journald = os.environ.get("JOURNAL_STREAM", "").split(":")
    try:
        on_journal = len(journald) == 2 and (os.fstat(2).st_dev, os.fstat(2).st_ino) == tuple(map(int, journald))
    except (OSError, ValueError):
        on_journal = False
    handler.setFormatter(logging.Formatter(LOG_FORMAT) if on_journal else _Dated(f"%(asctime)s {LOG_FORMAT}"))
    return handler


def _start_and_serve(args: argparse.Namespace, log: logging.Logger) -> int:
    """The ports opened, the parts built and served until the end."""
    from sandbox_server.cli.wiring import wire
    from sandbox_server.ops.memory import return_freed_memory
    from sandbox_server.protocol.addresses import listen, url_of
    from sandbox_server.protocol.http_limits import raise_open_files_limit
    from sandbox_server.sandbox.runc.runtime import RuncRuntime
    from sandbox_server.state.folder import default_state_dir

    open_files = raise_open_files_limit()  # bounded by the caps on connections, walks and sessions, never by hope
    return_freed_memory()  # what a burst of large calls held goes back to the host once they are answered
    listener = listen(args.host, args.port) if args.transport == "http" else None  # a taken port is said first
    log.info("open files: at most %d (the warm pools keep their sandboxes within a quarter of it)", open_files)
    # stdio: previews on a loopback port of their own, a free one unless one is named (links alone open them)
    wants_previews = args.transport == "stdio" and not args.no_preview
    preview_listener = listen("127.0.0.1", args.preview_port or 0) if wants_previews else None
    if listener is not None:
        preview_base: tuple[str, str] | None = ((args.public_url or url_of(listener)).removesuffix("/mcp"), args.host)
    elif preview_listener is not None:
        preview_base = (url_of(preview_listener).removesuffix("/mcp"), "127.0.0.1")
    else:
        preview_base = None
    runtime = RuncRuntime(None, args.sandboxes)
    _start_reaper(runtime.owner, Path(args.state_dir) if args.state_dir else default_state_dir())
    wired = wire(args, log, runtime, preview_base)
    anyio.run(_serve, args, wired, listener, preview_listener, log)
    return 0


async def _serve(
    args: argparse.Namespace, wired: Wired, listener: Any, preview_listener: Any, log: logging.Logger
) -> None:
    """The parts' loops beside the transport, until it ends or a signal comes; then, however it ended (a signal
    while it was starting included), the parts closed in order."""
    try:
        STOPPING.release()  # a signal since the parts started opening (cli/wiring.py) stops them now
        await _run_parts(args, wired, listener, preview_listener, log)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping (stdin closed, say): as in stop_on_signal
        with anyio.CancelScope(shield=True):
            await _close(wired, log)


async def _run_parts(
    args: argparse.Namespace, wired: Wired, listener: Any, preview_listener: Any, log: logging.Logger
) -> None:
    """The parts' loops beside the transport, until it ends or a signal comes."""
    from sandbox_server.policy.watcher import watch_policy
    from sandbox_server.protocol.addresses import url_of
    from sandbox_server.protocol.health import health_route
    from sandbox_server.protocol.http_limits import ConnectionLimits
    from sandbox_server.protocol.preview import serve_previews
    from sandbox_server.protocol.transports import serve_http, serve_stdio

    app, runtime, database, pool, drain = wired.app, wired.runtime, wired.database, wired.pool, wired.drain

    async def stop_on_signal(scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            why = await _signal_or_drain(signals, drain if listener is not None else None)
            if listener is not None:  # HTTP: out of service first, what runs here let finish (serve --grace-s)
                await _drained(drain, why, signals, wired.tasks.running, log)
        # Stopping from now on: a second SIGTERM (a supervisor's, a client's grace period running out) would end
        # the process before it removed its containers and unmounted its workspaces. SIGKILL still ends it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        log.info("%s: shutting down", why)
        if listener is None:
            scope.cancel()
        else:  # HTTP stops as uvicorn stops (its lifespan ended in order), then the rest is cancelled
            drain.stopping.set()

    async def watch() -> None:
        reload = lambda: host_facts(runtime)  # noqa: E731
        await watch_policy(args.policy, Path(wired.policy.source), wired.tool_names, reload, app.swap_policy)

    async with anyio.create_task_group() as group:
        group.start_soon(stop_on_signal, group.cancel_scope)
        await group.start(wired.tasks.serve)  # before the first request: a task may be asked for at once
        await group.start(wired.services.serve)
        await group.start(app.parked.serve)  # 2026-07-28 calls asking about hosts run beside their requests
        group.start_soon(_surviving, "the workspace sweep", functools.partial(_sweep_workspaces, wired, log), log)
        if (every := wired.audit.seal_interval_s) is not None:
            sealing = functools.partial(_seal_audit, wired.audit, every)
            group.start_soon(_surviving, "the audit trail's seals", sealing, log)
        if database is not None:
            address = _address(listener, args.advertise) if listener is not None else None
            await anyio.to_thread.run_sync(database.beat, drain.active, address)  # peers know where it is at once
            beat = functools.partial(_beat, database, drain, log, address)
            group.start_soon(_surviving, "the replica's heartbeat", beat, log)
        if pool is not None:
            group.start_soon(_surviving, "the warm pool", pool.maintain, log)
        if not args.no_watch:
            group.start_soon(_surviving, "the policy watcher", watch, log)
        previews = wired.previews
        if listener is not None:
            log.info("serving MCP over Streamable HTTP at %s", url_of(listener))
            checks = (
                {"engine": functools.partial(_engine_problem, runtime)}
                | ({"state": database.problem} if database is not None else {})
                | {"serving": drain.problem}
            )
            routes = [*(previews.routes() if previews is not None else []), health_route(checks), *wired.routes]
            await serve_http(
                app, args.host, listener, wired.authentication, ConnectionLimits.of(args),
                args.max_request_bytes, routes, drain,
            )  # fmt: skip
        else:
            if preview_listener is not None and previews is not None:
                group.start_soon(serve_previews, previews, preview_listener)
            await serve_stdio(app)
        group.cancel_scope.cancel()


async def _signal_or_drain(signals: Any, drain: Drain | None) -> str:
    """Wait for SIGTERM or SIGINT, or (HTTP) for draining to begin otherwise: what ended the wait."""
    said = ""
    async with anyio.create_task_group() as group:

        async def signalled() -> None:
            nonlocal said
            said = signal.Signals(await signals.__anext__()).name
            group.cancel_scope.cancel()

        async def asked(began: anyio.Event) -> None:
            nonlocal said
            await began.wait()
            said = said or "drain asked through the shared state"
            group.cancel_scope.cancel()

        group.start_soon(signalled)
        if drain is not None:
            group.start_soon(asked, drain.began)
    return said


async def _drained(drain: Drain, why: str, signals: Any, tasks_running: Callable[[], int], log: logging.Logger) -> None:
    """Take no new work, and wait for what runs here within the grace period (a second signal ends the wait)."""
    drain.begin(why)
    log.info(
        "%s: draining: no new work taken; waiting up to %g s for %d request(s) and %d task(s) under way",
        why, drain.grace_s, drain.under_way, tasks_running(),
    )  # fmt: skip
    left: tuple[int, int] | None = None
    async with anyio.create_task_group() as group:

        async def again() -> None:
            received = await signals.__anext__()
            log.info("%s: stopping now, without waiting any longer", signal.Signals(received).name)
            group.cancel_scope.cancel()

        group.start_soon(again)
        left = await drain.settled(tasks_running)
        group.cancel_scope.cancel()
    requests, tasks = left if left is not None else (drain.under_way, tasks_running())
    if requests or tasks:
        log.warning("drained for %g s: %d request(s) and %d task(s) still under way end now", drain.grace_s, requests,
                    tasks)  # fmt: skip
    else:
        log.info("drained: nothing under way")


async def _close(wired: Wired, log: logging.Logger) -> None:
    """The parts closed in order: the workspaces homed here let go of (replicas with homes), sessions' workspaces,
    containers, the engine's connection, proxies, spans, and the shared state last."""
    runtime, pool, database = wired.runtime, wired.pool, wired.database
    homed = wired.workspaces.contents.homed
    if homed is not None:  # replicas with homes: the workspaces here are continued elsewhere from now on
        try:
            await anyio.to_thread.run_sync(homed.let_go_of_homes)
        except SandboxServerError as exc:  # the database does not answer: they are taken over once this one is lost
            log.warning("the workspaces homed here were not let go of: %s", exc)
    ended = wired.workspaces.end_sessions(runtime.owner)
    if ended:
        log.info("removed the workspace(s) of %d handshake session(s) that ended with the server", ended)
    async with anyio.create_task_group() as closing:  # the waiting and the used containers side by side
        if pool is not None:
            closing.start_soon(pool.close)
        closing.start_soon(anyio.to_thread.run_sync, runtime.removal.close)
    await anyio.to_thread.run_sync(runtime.close_connection)
    await anyio.to_thread.run_sync(wired.proxies.close)
    wired.workspaces.close()
    await anyio.to_thread.run_sync(wired.stop_tracing)  # the last spans go out
    await anyio.to_thread.run_sync(wired.audit.tick)  # the trail's last lines sealed
    if database is not None:
        await database.aclose()
        await anyio.to_thread.run_sync(database.close)


async def _surviving(name: str, work: Callable[[], Awaitable[None]], log: logging.Logger) -> None:
    """Run a task beside the transport; an OSError (a full descriptor table, say) is logged, and the task starts
    again a second later, rather than ending the server."""
    while True:
        try:
            await work()
            return
        except OSError as exc:
            log.warning("%s failed (%s); it starts again in %g s", name, exc, RESTART_S)
            await anyio.sleep(RESTART_S)


async def _seal_audit(audit: AuditLog, every_s: float) -> None:
    """Seal what the trail holds since its last seal, and let each ended epoch's key go, every `every_s`."""
    while True:
        await anyio.sleep(every_s)
        await anyio.to_thread.run_sync(audit.tick)


async def _sweep_workspaces(wired: Wired, log: logging.Logger) -> None:
    while True:
        await anyio.sleep(WORKSPACE_SWEEP_S)
        try:
            removed = await anyio.to_thread.run_sync(wired.workspaces.sweep, wired.alive)
        except SandboxServerError as exc:  # the shared state does not answer: swept at the next turn
            log.warning("workspace sweep: %s", exc)
            continue
        if removed:
            log.info("removed %d expired workspace(s)", removed)


def _address(listener: socket.socket, advertise: str | None) -> str:
    """Where peer replicas reach this one (serve --advertise, else where it listens)."""
    from sandbox_server.protocol.addresses import url_of

    return advertise or url_of(listener).removesuffix("/mcp")


async def _beat(database: Database, drain: Drain, log: logging.Logger, address: str | None) -> None:
    """Replicas: say this one is alive (and whether it drains), forget those that stopped saying so, and begin
    draining when an operator asked for it through the shared state (`replicas drain`)."""
    while True:
        await anyio.sleep(database.beat_s)
        try:
            await anyio.to_thread.run_sync(database.check)
            await database.acheck()
            asked = await anyio.to_thread.run_sync(database.beat, drain.active, address)
            if asked and drain.begin("asked through the shared state (sandbox-server replicas drain)"):
                log.info("draining: asked through the shared state")
            await anyio.to_thread.run_sync(database.forget_lost)
        except SandboxServerError as exc:
            log.warning("shared state: %s", exc)


def _engine_problem(runtime: DockerRuntime) -> str | None:
    try:
        runtime.api.ping()
    except Exception as exc:  # whatever the engine's client raises, the check says it
        return f"the engine does not answer ({exc})"
    return None


def _start_reaper(owner: str, state_dir: Path) -> None:
    """A small process that outlives this one: if this server is killed, it removes the server's containers and
    lets go of the workspaces it had mounted."""
    import os
    import subprocess

    workspaces = ["--workspaces", str(state_dir / "workspaces")]
    subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sandbox_server",
            "reap-after",
            "--pid",
            str(os.getpid()),
            "--owner",
            owner,
            *workspaces,
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the server's process group, so a signal to the group spares it
        close_fds=True,
    )
