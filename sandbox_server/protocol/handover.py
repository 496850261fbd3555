"""A workspace handed over between replicas with homes, for a call that cannot be forwarded to its home.

A handshake-era session lives on the replica it began on, so its calls are never forwarded
(protocol/forwarding.py forwards requests that carry no session). When such a call is for a workspace homed on
another live replica, this replica asks that home, over the replicas' signed channel, to let go of it: the home
waits for no call (it answers "not now" while one works there), stops the workspace's services for them to
start again with its next call, saves the workspace, unmounts it and homes it nowhere. This replica then
becomes its home and continues it from that save, as a replica that took over a drained one does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from sandbox_server.protocol.draining import FORWARDED
from sandbox_server.protocol.forwarding import HEADER, signed_by
from sandbox_server.services.manager import Services
from sandbox_server.state.homes import Homes
from sandbox_server.workspaces.contents import Homing
from sandbox_server.workspaces.naming import ID_PATTERN

__all__ = ["HAND_OVER_PATH", "asking_for", "hand_over_route"]

log = logging.getLogger("sandbox_server")

HAND_OVER_PATH = "/replicas/hand-over"
ASK_S = 30.0
"""How long a replica waits for the home to answer (its save of a large workspace included)."""


def hand_over_route(homed: Homing, holds: Callable[[str], int], services: Services) -> Route:
    """The route a peer replica (its request signed) asks this home to let go of a workspace on: 200 once it is
    homed nowhere (or was not here), 409 while a call works in it or it could not be saved. `holds` counts the
    calls and services of this replica holding a workspace."""

    async def hand_over(request: Request) -> Response:
        peer = request.scope.get(FORWARDED)
        if not peer:
            return PlainTextResponse("only a replica, its request signed, asks for a workspace\n", status_code=403)
        try:
            workspace = str(json.loads(await request.body())["workspace"])
        except (ValueError, KeyError, TypeError):
            return PlainTextResponse("a JSON object naming the workspace\n", status_code=400)
        if not ID_PATTERN.fullmatch(workspace) or not homed.homed_here(workspace):
            return PlainTextResponse("not homed here\n")
        holding = services.running(workspace, stopping=True)
        if holds(workspace) > len(holding):
            return PlainTextResponse("a call works in it now\n", status_code=409)
        for service in services.running(workspace):  # started again by the workspace's next call, there
            service.resumable = True
            await services.stop(service, f"its workspace moved to replica {peer}")
        for service in holding:
            await service.let_go.wait()
        if not await anyio.to_thread.run_sync(homed.hand_over, workspace, lambda held: holds(held) > 0):
            return PlainTextResponse("a call works in it now, or it could not be saved\n", status_code=409)
        log.info("workspace %s handed over to replica %s, which has a call for it", workspace, peer)
        return PlainTextResponse("let go of\n")

    return Route(HAND_OVER_PATH, hand_over, methods=["POST"])


def asking_for(homes: Homes, key: bytes) -> Callable[[str], bool]:
    """What a replica asks a workspace's home with (off the event loop; signed with the replicas' forwarding
    `key`): whether the home let go of it."""

    def ask(workspace_id: str) -> bool:
        import httpx2

        home = homes.of_workspace(workspace_id)
        if home is None:  # homed nowhere else now, or on a replica that is lost: claimed as it is
            return True
        body = json.dumps({"workspace": workspace_id}).encode()
        headers = {
            HEADER: signed_by(key, homes.me, "POST", HAND_OVER_PATH, body, {}),
            "content-type": "application/json",
        }
        try:
            answer = httpx2.post(
                home.address.rstrip("/") + HAND_OVER_PATH, content=body, headers=headers, timeout=ASK_S
            )
        except httpx2.HTTPError as exc:
            log.info(
                "replica %s, home of workspace %s, did not answer its hand-over: %s", home.replica, workspace_id, exc
            )
            return False
        return answer.status_code == 200

    return ask
