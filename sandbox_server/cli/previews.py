"""Where a server serves its services' previews and whether its answers link to them: none without an address,
and no link where no person could open one (the engine elsewhere, no root for the service's namespace, a server
listening on every address without --public-url), each said with what to change."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from sandbox_server.policy import Policy
    from sandbox_server.protocol.preview import Previews
    from sandbox_server.sandbox.engine.runtime import DockerRuntime
    from sandbox_server.services.links import PreviewLinks
    from sandbox_server.services.manager import Services

__all__ = ["preview_links", "preview_origin", "preview_routes"]


def preview_links(runtime: DockerRuntime, preview_base: tuple[str, str] | None) -> PreviewLinks:
    """The links answers give to services' previews: none when previews are not served, or where no person could
    open them (and the answers say why)."""
    from sandbox_server.sandbox.runc import netns
    from sandbox_server.services.links import PreviewLinks

    if preview_base is None:
        return PreviewLinks(None, "this server was started with --no-preview; serve without it for a link")
    why_not = netns.unavailable() or (None if runtime.on_this_host() else "the engine is elsewhere")
    if why_not is not None:
        return PreviewLinks(
            preview_base[0],
            f"{why_not}; previews need the server to run as root beside its engine (the calls of the workspace "
            "still reach the service by its name)",
        )
    if urlsplit(preview_base[0]).hostname in ("0.0.0.0", "::"):  # no address a person could open
        return PreviewLinks(
            preview_base[0],
            "this server listens on every address and cannot tell the one people reach it at: serve with "
            "--public-url URL (its own or its load balancer's address) for preview links",
        )
    return PreviewLinks(preview_base[0])


def preview_routes(
    args: argparse.Namespace,
    policy: Policy,
    services: Services,
    preview_base: tuple[str, str] | None,
    log: logging.Logger,
) -> Previews | None:
    """The services' preview routes (None: no address to serve them at), and whether answers link to them said."""
    from sandbox_server.protocol.addresses import allowed_hosts, host_names
    from sandbox_server.protocol.preview import Previews

    if preview_base is None:
        return None
    base_url, host = preview_base
    public = urlsplit(args.public_url).hostname if args.public_url else None
    previews = Previews(services, allowed_hosts(host_names(host, public)), args.frame_ancestor)
    if policy.services.tools or args.tokens or args.issuer:  # callers' own policies may start services
        if services.links.given:
            log.info("services' previews at %s/preview/", base_url)
        else:
            log.warning("services' answers give no preview link: %s", services.links.why_not)
    return previews


def preview_origin(args: argparse.Namespace, links: PreviewLinks) -> str | None:
    """Where a view may frame previews from: the origin they are served at, when answers link to them and MCP
    hosts were named to frame them (serve --frame-ancestor)."""
    if not links.given or not args.frame_ancestor or links.base_url is None:
        return None
    parts = urlsplit(links.base_url)
    return f"{parts.scheme}://{parts.netloc}"
