"""The parts of `serve`, each built once, in order, and handed its collaborators in its constructor.

The order follows what each part needs: the engine and the shared state first, then the policy, the warm pool,
the workspaces, the proxies, the tools' registry, the tasks and the services, and last the server that serves
them. Two parts need each other (the pool counts the memory of the services that tell it their networks, the
services' previews are served by routes that find the services): those hear of each other through a function
that looks the other up when called, never by setting an attribute after construction.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio

from sandbox_server.errors import SandboxServerError, UsageError
from sandbox_server.ops.bootstrap import host_facts

if TYPE_CHECKING:
    from starlette.routing import Route

    from sandbox_server.access.auth import Authentication
    from sandbox_server.access.shared import SharedAccess, SharedTokens
    from sandbox_server.calls.metrics import Metrics
    from sandbox_server.calls.tracing import Tracing
    from sandbox_server.network.proxies import EgressProxies
    from sandbox_server.policy import Policy
    from sandbox_server.protocol.draining import Drain
    from sandbox_server.protocol.preview import Previews
    from sandbox_server.protocol.server import SandboxServer
    from sandbox_server.sandbox.docker_runtime import DockerRuntime
    from sandbox_server.sandbox.pool import WarmPool
    from sandbox_server.services.manager import Services
    from sandbox_server.state.database import Database
    from sandbox_server.tasks.manager import Tasks
    from sandbox_server.workspaces.contents import Contents
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


def wire(
    args: argparse.Namespace, log: logging.Logger, runtime: DockerRuntime, preview_base: tuple[str, str] | None
) -> Wired:
    """Build every part of a server from its options, on the engine `runtime`; `preview_base` is the address
    previews are served at and the host the server listens on (None: previews are not served)."""
    from sandbox_server.access.audit import AuditLog
    from sandbox_server.calls.registry import ToolRegistry
    from sandbox_server.network.proxies import EgressProxies
    from sandbox_server.policy.loader import load_policy
    from sandbox_server.protocol.draining import Drain
    from sandbox_server.sandbox.pool import WarmPool
    from sandbox_server.sandbox.removal import owner_alive
    from sandbox_server.tools import all_tools

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
    for note in policy.notes:
        log.warning("policy %r: %s", policy.name, note)
    _packages_built(policy, names, runtime, args.policy)
    try:
        reaped = runtime.reap_strays()
        if reaped:
            log.info("removed %d stray sandbox container(s)", reaped)
    except SandboxServerError as exc:
        log.warning("%s", exc)

    def held_elsewhere() -> int:  # running tasks' and services' containers count against warm containers' memory
        return tasks.memory_bytes() + services.memory_bytes()

    _sandboxes(runtime, log)
    pool = None if args.no_pool else WarmPool(runtime, runtime.activity, held_elsewhere)
    workspaces = _workspaces(args, runtime, database, policy, alive, log)
    try:  # from here, a start that fails (or is stopped) undoes what it began
        # The audit trail is kept by default, in the state folder (readable by the server's user alone).
        audit_path = args.audit_log or policy.audit.path or workspaces.root.parent / "audit.jsonl"
        replica = runtime.owner if database is not None else None
        audit = AuditLog(audit_path, policy.audit.max_bytes, policy.audit.keep, replica, policy.audit.max_age_h * 3600)
        log.info("audit trail: %s", audit.path)
        proxies = EgressProxies(lambda: runtime.api, runtime.owner, runtime.on_this_host)
        proxies.sweep_firewall()  # the rules of proxies whose server was killed
        caller_policies: dict[str, Policy] = {}

        def caller_policy(reference: str) -> Policy:
            """A token's policy, loaded once for this host (the server's own, with its reloads, when it names that)."""
            if reference == args.policy:
                return registry.policy
            if reference not in caller_policies:
                caller_policies[reference] = load_policy(reference, names, host_facts(runtime))
            return caller_policies[reference]

        authenticated = bool(args.tokens or args.issuer)
        registry = ToolRegistry(
            tools, policy, pool, proxies, workspaces, caller_policy if authenticated else None, args.tool_prefix
        )
        if pool is not None:  # the slowest containers start now, while the MCP SDK (a second of imports) loads
            pool.head_start()
        from sandbox_server.protocol.addresses import allowed_hosts, host_names
        from sandbox_server.protocol.preview import Previews
        from sandbox_server.protocol.server import Parts, SandboxServer
        from sandbox_server.sandbox import netns
        from sandbox_server.services.manager import Services
        from sandbox_server.tasks.manager import Tasks

        rows = None
        if database is not None:
            from sandbox_server.tasks.shared import TaskRows

            rows = TaskRows(database)
        tasks = Tasks(workspaces.root.parent / "tasks", runtime.owner, audit, alive, rows)
        metrics, routes = _metrics(args, log)
        if metrics is not None:
            from sandbox_server.calls.metrics import StorageCollector

            metrics.registry.register(StorageCollector(workspaces.holdings))
        previews: Previews | None = None
        linked = False  # whether answers carry preview links: the server can reach services from this host

        def preview_of(service: Any) -> str | None:
            return previews.link(service) if previews is not None and linked else None

        why_not = netns.unavailable() or (None if runtime.on_this_host() else "the engine is elsewhere")
        if preview_base is None:
            no_preview = "this server was started with --no-preview; serve without it for a link"
        elif why_not is not None:
            no_preview = (
                f"{why_not}; previews need the server to run as root beside its engine (the calls of the workspace "
                "still reach the service by its name)"
            )
        elif urlsplit(preview_base[0]).hostname in ("0.0.0.0", "::"):  # no address a person could open
            no_preview = (
                "this server listens on every address and cannot tell the one people reach it at: serve with "
                "--public-url URL (its own or its load balancer's address) for preview links"
            )
        else:
            no_preview = ""
        services = Services(
            runtime, workspaces, audit, proxies,
            on_networks=registry.service_networks if pool is not None else lambda _: None,  # warm containers beside them
            preview_of=preview_of, observe=metrics.observe if metrics is not None else None, no_preview=no_preview,
        )  # fmt: skip
        if preview_base is not None:
            base_url, host = preview_base
            public = urlsplit(args.public_url).hostname if args.public_url else None
            previews = Previews(services, base_url, allowed_hosts(host_names(host, public)), args.frame_ancestor)
            linked = not no_preview
            said = policy.services.tools or args.tokens or args.issuer  # callers' own policies may start services
            if said and linked:
                log.info("services' previews at %s/preview/", base_url)
            elif said:
                log.warning("services' answers give no preview link: %s", no_preview)
        tracing, stop_tracing = _tracing(args, runtime.owner, log)
        app = SandboxServer(
            Parts(
                registry, pool if pool is not None else runtime, audit, (metrics.observe,) if metrics is not None else (),
                tracing, tasks, services, _shared_access(database), runtime.owner, args.page_size,
                preview_origin=_origin(preview_base[0]) if preview_base is not None and linked and args.frame_ancestor else None,
            )
        )  # fmt: skip
        authentication = _authentication(args, caller_policy, log, database)
        if authentication is not None:  # warm containers for every policy a caller may have, from the start
            app.know_policies(authentication.verifier.policies())
        return Wired(
            app, runtime, policy, names, database, pool, workspaces, proxies, tasks, services, authentication, routes,
            previews, stop_tracing, alive, Drain(getattr(args, "grace_s", 30.0), _peers(database, services)),
        )  # fmt: skip
    except BaseException:  # a server that does not start leaves none of its first containers nor mounts behind
        if pool is not None:
            anyio.run(pool.close)
        workspaces.close()
        raise


def _origin(url: str) -> str:
    """scheme://host[:port] of a URL (where a view may frame previews)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


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


def _workspaces(
    args: argparse.Namespace,
    runtime: DockerRuntime,
    database: Database | None,
    policy: Policy,
    alive: Callable[[str], bool],
    log: logging.Logger,
) -> WorkspaceStore:
    """The kept workspaces, in this server's own state folder, swept of what expired while it was away."""
    from sandbox_server.state.folder import claim_state_folder, default_state_dir
    from sandbox_server.workspaces.store import WorkspaceStore

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

        book = SharedBook(database)
        contents = functools.partial(SharedArchives, book=book)
        if args.workspaces == "mounted":
            contents = _homed(runtime, book, policy, contents)
            log.info("workspaces are mounted on their home replica, each saved to the shared state after its calls")
        else:
            log.info("workspaces are kept as archives in the shared state, continued on any replica")
    workspaces = WorkspaceStore(
        state_dir / "workspaces", policy.workspace, policy.host.workspace_storage_mb * 1024 * 1024, contents, book,
        alive if database is not None else None, callers_share_the_host=bool(args.tokens or args.issuer),
    )  # fmt: skip
    swept = workspaces.sweep(alive)
    if swept:
        log.info("removed %d expired or orphaned workspace(s)", swept)
    return workspaces


def _authentication(
    args: argparse.Namespace, caller_policy: Callable[[str], Policy], log: logging.Logger, database: Database | None
) -> Authentication | None:
    """Who may call over HTTP: the tokens file's callers and the issuer's (None: no authentication)."""
    from sandbox_server.access.auth import Authentication, JwtVerifier, PolicyRule, StaticTokenVerifier, jwks_url_of
    from sandbox_server.access.tokens import TokensFile, policies_said
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
        callers = tokens.callers()
        log.info("HTTP callers need a token of %s (%d caller(s))", where, len(callers))
        lines, warning = policies_said(callers, args.policy)
        for line in lines:
            log.info("%s", line)
        if warning is not None:
            log.warning("%s", warning)
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


def _metrics(args: argparse.Namespace, log: logging.Logger) -> tuple[Metrics | None, list[Route]]:
    """Metrics counting every call and the /metrics route that serves them (serve --metrics-token-file); none
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
    from sandbox_server.calls.metrics import Metrics
    from sandbox_server.protocol.metrics import metrics_route

    metrics = Metrics()
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


def _homed(runtime: DockerRuntime, book: Any, policy: Policy, archives: Callable[[Path], Any]) -> Callable[[Path], Any]:
    """Replicas with mounted workspaces (serve --state … --workspaces mounted): each lives on its home replica."""
    from sandbox_server.sandbox import mounts
    from sandbox_server.sandbox.removal import owner_alive
    from sandbox_server.state.homes import Homes
    from sandbox_server.workspaces.homed import HomedMounts

    why_not = mounts.unavailable(runtime.on_this_host())
    if why_not is not None:
        raise SandboxServerError(f"--workspaces mounted: kept workspaces cannot be mounted here: {why_not}")
    homes = Homes(book.database)
    return lambda root: HomedMounts(
        root, runtime.owner, owner_alive, runtime.activity, archives(root), homes, policy.workspace
    )


def _peers(database: Database | None, services: Any) -> Any:
    """Replicas with homes: the forwarding of what lives on a peer to it, keyed with a secret the replicas share."""
    if database is None or services.homes is None:
        return None
    from sandbox_server.protocol.forwarding import Forwarding

    here, runs_here = services.store.contents.homed_here, lambda service: services.get(service) is not None
    return Forwarding(services.homes, database.key("forwarding"), here, runs_here).wrap


def _shared_access(database: Database | None) -> SharedAccess | None:
    if database is None:
        return None
    from sandbox_server.access.shared import SharedAccess

    return SharedAccess.of(database)


def _sandboxes(runtime: DockerRuntime, log: logging.Logger) -> None:
    """Who makes calls' sandboxes (serve --sandboxes), said once at start."""
    from sandbox_server.sandbox.runc_runtime import RuncRuntime

    why_not = runtime.runc_refused() if isinstance(runtime, RuncRuntime) else "its only path"
    if why_not is None:
        log.info(
            "calls' sandboxes without a network are made by runc itself from the engine's images; others by the engine"
        )
    else:
        log.info("calls' sandboxes are made by the engine (%s)", why_not)


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
