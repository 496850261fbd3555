"""The parts of `serve`, each built once, in order, and handed its collaborators in its constructor.

`wire` is the list of steps: each builds one part from the parts before it and hands it on. The engine and the
shared state come first, then the policy, the warm pool, the workspaces, the proxies, the tools' registry, the
tasks and the services, and last the server that serves them. Where a part made early must hear of parts made
later, it is handed a small object made before both that the later ones join as they are made: the warm pool
reads the memory the tasks and services say they hold (`sandbox.held.HeldMemory`), the services' answers link
to previews through `services.links.PreviewLinks`. Nothing is set on a part after it was made, and no step
reads a part a later step makes. From the workspaces on, a start that fails is undone in one place.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from sandbox_server.cli import callers
from sandbox_server.cli.previews import preview_links, preview_origin, preview_routes
from sandbox_server.cli.stopping import STOPPING
from sandbox_server.cli.storage import host_folders, workspace_store
from sandbox_server.errors import SandboxServerError, UsageError
from sandbox_server.ops.bootstrap import host_facts

if TYPE_CHECKING:
    from starlette.routing import Route
    from starlette.types import ASGIApp

    from sandbox_server.access.audit import AuditLog
    from sandbox_server.access.auth import Authentication
    from sandbox_server.calls.metrics import Metrics
    from sandbox_server.calls.registry import ToolRegistry
    from sandbox_server.calls.tracing import Tracing
    from sandbox_server.network.proxies import EgressProxies
    from sandbox_server.policy import Policy
    from sandbox_server.protocol.draining import Drain
    from sandbox_server.protocol.preview import Previews
    from sandbox_server.protocol.server import SandboxServer
    from sandbox_server.sandbox.engine.runtime import DockerRuntime
    from sandbox_server.sandbox.held import HeldMemory
    from sandbox_server.sandbox.pool import WarmPool
    from sandbox_server.services.links import PreviewLinks
    from sandbox_server.services.manager import Services
    from sandbox_server.state.database import Database
    from sandbox_server.tasks.manager import Tasks
    from sandbox_server.tools.base import Tool
    from sandbox_server.workspaces.store import WorkspaceStore

__all__ = ["Wired", "wire"]


@dataclass(frozen=True, slots=True)
class Wired:
    """A server's parts, built: what `serve` runs beside its transport and closes at the end."""

    app: SandboxServer
    runtime: DockerRuntime
    policy: Policy
    """The policy the server started with (its file is watched for changes)."""
    tool_names: list[str]
    database: Database | None
    pool: WarmPool[Any] | None
    workspaces: WorkspaceStore
    proxies: EgressProxies
    tasks: Tasks
    services: Services
    authentication: Authentication | None
    routes: list[Route]
    """Served beside /mcp over HTTP: /metrics when asked for (the health and preview routes are the transport's)."""
    previews: Previews | None
    """The services' preview routes (None: no address to serve them at)."""
    stop_tracing: Callable[[], None]
    alive: Callable[[str], bool]
    """Whether a server process (a replica, with shared state) still runs."""
    drain: Drain
    """How the server leaves service over HTTP (serve --grace-s)."""
    audit: AuditLog
    """The audit trail, sealed on a timer while the server runs and once more as it stops."""


def wire(
    args: argparse.Namespace, log: logging.Logger, runtime: DockerRuntime, preview_base: tuple[str, str] | None
) -> Wired:
    """Build every part of a server from its options, on the engine `runtime`; `preview_base` is the address
    previews are served at and the host the server listens on (None: previews are not served)."""
    from sandbox_server.protocol.draining import Drain
    from sandbox_server.protocol.server import Parts, SandboxServer
    from sandbox_server.sandbox.held import HeldMemory
    from sandbox_server.sandbox.pool import WarmPool
    from sandbox_server.sandbox.runc.runtime import RuncRuntime

    database = _shared_state(args, runtime.owner, log)
    alive = _liveness(database)
    policy, tools = _policy(args, runtime, log)
    _clear_strays(runtime, log)
    held = HeldMemory()  # running tasks' and services' containers count against warm containers' memory
    runc_makes = runtime.makes_itself if isinstance(runtime, RuncRuntime) else None
    pool = None if args.no_pool else WarmPool(runtime, runtime.activity, held, runc_makes, args.pool_sandboxes)
    # From the workspaces' mounts on, a signal waits for the parts to be served (cli/serve.py releases it where
    # their closing is sure): one that came while the store opened, or just after, would leave its mounts behind.
    STOPPING.hold()
    with _undone_unless_started(pool) as undo:
        workspaces = workspace_store(args, runtime, database, policy, alive, log)
        undo.callback(workspaces.close)
        audit = _audit(args, policy, workspaces.root.parent, runtime.owner if database is not None else None, log)
        proxies = _proxies(runtime)
        registry = _registry(args, tools, policy, pool, proxies, workspaces, runtime)
        if pool is not None:  # the slowest containers start now, while the MCP SDK (a second of imports) loads
            pool.head_start()
        tasks = _tasks(workspaces.root.parent, runtime.owner, audit, alive, database, held)
        metrics, routes = _metrics(args, workspaces, log)
        links = preview_links(runtime, preview_base)
        services = _services(
            runtime, workspaces, audit, proxies, registry if pool is not None else None, links, metrics, held
        )
        previews = preview_routes(args, policy, services, preview_base, log)
        tracing, stop_tracing = _tracing(args, runtime.owner, log)
        app = SandboxServer(
            Parts(
                registry, pool or runtime, audit, (metrics.observe,) if metrics is not None else (), tracing, tasks,
                services, callers.shared_access(database), runtime.owner, args.page_size, preview_origin=preview_origin(args, links),
                host_folders=host_folders(runtime, workspaces.root.parent, audit.path.parent),
            )
        )  # fmt: skip
        authentication = callers.authentication(args, registry.named, log, database)
        if authentication is not None:  # warm containers for every policy a caller may have, from the start
            app.know_policies(authentication.verifier.policies())
        return Wired(
            app, runtime, policy, [tool.name for tool in tools], database, pool, workspaces, proxies, tasks, services,
            authentication, routes, previews, stop_tracing, alive, Drain(args.grace_s, _peers(database, services, routes)),
            audit,
        )  # fmt: skip


@contextlib.contextmanager
def _undone_unless_started(pool: WarmPool[Any] | None) -> Iterator[contextlib.ExitStack]:
    """A server that does not start (a part fails, or a signal stops it) leaves none of its first containers nor
    mounts behind: the parts opened in the block are closed, last first, unless it ends with them started."""
    with contextlib.ExitStack() as undo:
        if pool is not None:
            undo.callback(anyio.run, pool.close)
        yield undo
        undo.pop_all()


def _liveness(database: Database | None) -> Callable[[str], bool]:
    """Whether a server process (a replica, with shared state) still runs; a database that does not answer tells
    nothing, and nothing is taken for dead on its silence."""
    from sandbox_server.sandbox.engine.removal import owner_alive

    def alive(owner: str) -> bool:
        if not owner_alive(owner):
            return False
        try:
            return database is None or database.alive(owner)
        except SandboxServerError:
            return True

    return alive


def _policy(args: argparse.Namespace, runtime: DockerRuntime, log: logging.Logger) -> tuple[Policy, list[Tool]]:
    """The server's policy for this host, its notes said, with the images its tools need built; and the tools."""
    from sandbox_server.policy.loader import load_policy
    from sandbox_server.tools import all_tools

    tools = all_tools()
    names = [tool.name for tool in tools]
    policy = load_policy(args.policy, names, host_facts(runtime))
    for note in policy.notes:
        log.warning("policy %r: %s", policy.name, note)
    _packages_built(policy, names, runtime, args.policy)
    return policy, tools


def _clear_strays(runtime: DockerRuntime, log: logging.Logger) -> None:
    """The sandboxes a killed server left behind are removed; who makes calls' sandboxes is said."""
    from sandbox_server.sandbox.runc.runtime import RuncRuntime
    from sandbox_server.sandbox.runc.state import runsc_path

    try:
        reaped = runtime.reap_strays()
        if reaped:
            log.info("removed %d stray sandbox container(s)", reaped)
    except SandboxServerError as exc:
        log.warning("%s", exc)
    why_not = runtime.runc_refused() if isinstance(runtime, RuncRuntime) else "its only path"
    if why_not is None:
        gvisor = "by runsc itself" if runsc_path() is not None else "by the engine (no runsc here)"
        assert isinstance(runtime, RuncRuntime)
        made = "forked from a template per image (runc's if it has no python3)" if runtime.templates else "made by runc"
        log.info("calls' sandboxes are %s from the engine's images (gVisor's %s); services, image builds and the "
                 "proxy by the engine", made, gvisor)  # fmt: skip
        shared = runtime.own_ids_refused()
        if shared is None:
            log.info("each of runc's sandboxes runs as host ids of its own (a user namespace of its own)")
        else:
            log.warning("runc's sandboxes share the sandbox user's host ids and its per-user limits: %s", shared)
    else:
        log.info("calls' sandboxes are made by the engine (%s)", why_not)


def _audit(args: argparse.Namespace, policy: Policy, state: Path, replica: str | None, log: logging.Logger) -> AuditLog:
    """The audit trail, kept by default in the state folder (readable by the server's user alone)."""
    from sandbox_server.access.audit import AuditLog

    path = args.audit_log or policy.audit.path or state / "audit.jsonl"
    settings = policy.audit
    audit = AuditLog(
        path, settings.max_bytes, settings.keep, replica, settings.max_age_h * 3600, settings.seal_interval_s
    )
    log.info("audit trail: %s", audit.path)
    kept = audit.begin_sealing()
    if kept is not None:
        log.warning(
            "the audit trail is sealed from now on (every %d s, audit.seal_interval_s); its verification key is in "
            "%s: move it off this machine (a key kept beside the trail vouches for nothing against whoever holds the "
            "machine) and check the trail with `sandbox-server audit verify --key FILE`",
            settings.seal_interval_s, kept,
        )  # fmt: skip
    return audit


def _proxies(runtime: DockerRuntime) -> EgressProxies:
    """The egress proxies of allow lists, with the firewall rules of proxies whose server was killed swept."""
    from sandbox_server.network.firewall import sweep_firewall
    from sandbox_server.network.proxies import EgressProxies

    sweep_firewall()
    from sandbox_server.sandbox.runc.state import STATE, proxies_folder

    folder = proxies_folder(STATE, runtime.owner)  # memory-backed, root's, removed with what the server leaves
    return EgressProxies(lambda: runtime.api, runtime.owner, runtime.on_this_host, folder)


def _registry(
    args: argparse.Namespace,
    tools: list[Tool],
    policy: Policy,
    pool: WarmPool[Any] | None,
    proxies: EgressProxies,
    workspaces: WorkspaceStore,
    runtime: DockerRuntime,
) -> ToolRegistry:
    """The tools by the names clients see, and the policies calls run under: a token's is loaded once for this
    host (the server's own, with its reloads, when the token names that)."""
    from sandbox_server.calls.registry import ToolRegistry
    from sandbox_server.policy.loader import load_policy

    names = [tool.name for tool in tools]
    loaded = functools.cache(lambda reference: load_policy(reference, names, host_facts(runtime)))
    authenticated = bool(args.tokens or args.issuer)
    return ToolRegistry(
        tools, policy, pool, proxies, workspaces, loaded if authenticated else None, args.tool_prefix, args.policy
    )


def _tasks(
    state: Path, owner: str, audit: AuditLog, alive: Callable[[str], bool], database: Database | None, held: HeldMemory
) -> Tasks:
    """The tasks of this server (and, with shared state, the rows where replicas find one another's)."""
    from sandbox_server.tasks.manager import Tasks

    rows = None
    if database is not None:
        from sandbox_server.tasks.shared import TaskRows

        rows = TaskRows(database)
    return Tasks(state / "tasks", owner, audit, alive, rows, held)


def _services(
    runtime: DockerRuntime,
    workspaces: WorkspaceStore,
    audit: AuditLog,
    proxies: EgressProxies,
    pooled: ToolRegistry | None,
    links: PreviewLinks,
    metrics: Metrics | None,
    held: HeldMemory,
) -> Services:
    """The services of workspaces; warm containers wait beside their networks when there is a pool (`pooled`)."""
    from sandbox_server.sandbox.runc.runtime import RuncRuntime
    from sandbox_server.services.manager import Services

    def networks_changed(named: Mapping[str, Mapping[str, str]]) -> None:
        if isinstance(runtime, RuncRuntime):  # its sandboxes beside services find them by these names
            runtime.name_services(named)
        if pooled is not None:  # warm containers wait on the networks with services running
            pooled.service_networks(set(named))

    return Services(
        runtime, workspaces, audit, proxies,
        on_networks=networks_changed,
        links=links, observe=metrics.observe if metrics is not None else None, held=held,
    )  # fmt: skip


def _packages_built(policy: Policy, names: list[str], runtime: DockerRuntime, reference: str) -> None:
    """A tool whose policy adds packages, or names a build context, runs in the image they make: refused at start
    when it is not built."""
    for name in names:
        tool = policy.for_tool(name)
        made_by = f"packages ({tool.packages[1]})" if tool.packages is not None else f"build ({tool.build})"
        if (tool.packages is not None or tool.build is not None) and runtime.image(tool.image) is None:
            raise UsageError(
                f"policy {policy.name!r}: tools.{name}.{made_by} makes the image {tool.image}, "
                f"which is not built: run `sandbox-server images build --policy {reference}`"
            )


def _shared_state(args: argparse.Namespace, owner: str, log: logging.Logger) -> Database | None:
    """The shared state's database (serve --state, SANDBOX_STATE_URL), connected and migrated, with this replica's
    name taken (serve --name, else the host's); None without."""
    import os
    import socket

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
    from sandbox_server.sandbox.engine.removal import owner_alive

    database = Database(url, owner, name=args.name or socket.gethostname())
    database.open(alive=owner_alive)
    log.info("shared state: %s (replica %s, process %s)", shown_url(url), database.name, owner)
    return database


def _metrics(
    args: argparse.Namespace, workspaces: WorkspaceStore, log: logging.Logger
) -> tuple[Metrics | None, list[Route]]:
    """Metrics counting every call and the workspaces' storage, and the /metrics route that serves them (serve --metrics-token-file); none
    without."""
    if not args.metrics_token_file:
        return None, []
    if args.transport != "http":
        raise UsageError("--metrics-token-file serves /metrics over HTTP (--transport http)")
    try:
        token = Path(args.metrics_token_file).read_text().strip()
    except OSError as exc:
        raise UsageError(f"--metrics-token-file {args.metrics_token_file}: {exc.strerror}") from None
    if len(token) < 16 or not token.isprintable() or " " in token:
        raise UsageError(f"--metrics-token-file {args.metrics_token_file}: the token must be one word of 16 or more")
    from sandbox_server.calls.metrics import Metrics, StorageCollector
    from sandbox_server.protocol.metrics import metrics_route

    metrics = Metrics()
    metrics.registry.register(StorageCollector(workspaces.holdings))
    log.info("meters for Prometheus at /metrics, for a bearer of the metrics token")
    return metrics, [metrics_route(metrics, token)]


def _tracing(args: argparse.Namespace, owner: str, log: logging.Logger) -> tuple[Tracing | None, Callable[[], None]]:
    """Spans of each call over OTLP (serve --otlp-endpoint, OTEL_EXPORTER_OTLP_ENDPOINT), and how to flush them
    at the end (None, and nothing to flush, without)."""
    from sandbox_server.calls.tracing import otlp_tracing

    try:
        made = otlp_tracing(args.otlp_endpoint, owner)
    except ImportError as exc:
        raise UsageError(
            f"--otlp-endpoint needs OpenTelemetry ({exc.name} is missing): pip install 'sandbox-server[telemetry]'"
        ) from exc
    if made is None:
        return None, lambda: None
    log.info("spans of each call over OTLP to %s", args.otlp_endpoint or "the collector OTEL_EXPORTER_OTLP_* names")
    return made


def _peers(
    database: Database | None, services: Services, routes: list[Route]
) -> Callable[[ASGIApp, int], ASGIApp] | None:
    """Replicas with homes: the forwarding of what lives on a peer to it, keyed with a secret the replicas share,
    and the hand-over of a workspace to the replica a call that cannot be forwarded reached (a route of `routes`)."""
    homed = services.store.contents.homed
    if database is None or homed is None:
        return None
    from sandbox_server.protocol.forwarding import Forwarding
    from sandbox_server.protocol.handover import hand_over_route

    routes.append(hand_over_route(homed, services.store.holds, services))
    runs_here = lambda service: services.get(service) is not None  # noqa: E731
    return Forwarding(homed.homes, database.key("forwarding"), homed.homed_here, runs_here).wrap
