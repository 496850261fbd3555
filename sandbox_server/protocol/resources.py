"""Resources: the files kept from results and the files of a session's kept workspace, listed a page at a time
and read whole or, when large, in parts (`?offset=`) that each fit the message a client accepts."""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import mcp_types as types
from mcp.shared.exceptions import MCPError
from mcp_types.jsonrpc import INVALID_PARAMS

from sandbox_server.errors import Refusal
from sandbox_server.policy import Policy
from sandbox_server.protocol.listing import page_of
from sandbox_server.protocol.meta import PART_META
from sandbox_server.protocol.paging import requested_part
from sandbox_server.protocol.requests import Context, handshake_era, identity_of, session_of
from sandbox_server.protocol.results import ResourceStore
from sandbox_server.protocol.tasks import OUTPUT_TEMPLATE
from sandbox_server.services.manager import Services
from sandbox_server.workspaces.exports import EXPORT_PREFIX
from sandbox_server.workspaces.naming import LISTING_TEMPLATE, RESOURCE_TEMPLATE, listing_id
from sandbox_server.workspaces.resources import read_workspace_file, session_entries, workspace_listing
from sandbox_server.workspaces.store import WorkspaceStore

if TYPE_CHECKING:  # the PostgreSQL driver is imported only by a server given --state
    from sandbox_server.state.files import SharedFiles

__all__ = ["READ_PART_BYTES", "SERVICE_PREFIX", "Resources"]

RESOURCE_NOT_FOUND_HANDSHAKE = -32002
"""Handshake-era code for a missing resource; the 2026-07-28 era retired it for -32602."""
RESOURCES_PAGE = 500
"""Resources per resources/list page."""
SERVICE_PREFIX = "sandbox://services/"
READ_PART_BYTES = 512 * 1024
"""The most one resources/read returns: base64 makes it about 700 KB, within the 1 MiB message a client accepts."""


class Resources:
    """The resources handlers over the result files' store and the kept workspaces."""

    def __init__(
        self,
        store: ResourceStore,
        workspaces: WorkspaceStore | None,
        policy: Callable[[], Policy],
        instance: str,
        task_output: Callable[[Context, str], Awaitable[types.ReadResourceResult | None]] | None = None,
        services: Services | None = None,
        shared_files: SharedFiles | None = None,
    ) -> None:
        self.store = store
        self.services = services
        """The running services, each listed and read by its own caller (sandbox://services/<id>)."""
        self.shared_files = shared_files
        """Replicas: files other replicas' calls returned (None: this process's own alone)."""
        self._task_output = task_output
        """A task's output so far, by its URI (sandbox://tasks/<id>/output), when its caller asks."""
        self.workspaces = workspaces
        self._policy = policy
        """The server's policy as it is now (its default returned_file_bytes caps a workspace file's read)."""
        self.instance = instance

    async def list(self, ctx: Context, params: types.PaginatedRequestParams | None) -> types.ListResourcesResult:
        tenant = identity_of(ctx).tenant
        found: dict[str, types.Resource] = {}
        for uri in self.store.uris(tenant):
            kept = self.store.get(uri, tenant)
            if kept:
                name = uri.rsplit("/", 1)[-1]
                found[uri] = types.Resource(uri=uri, name=name, mime_type=kept[0], size=len(kept[1]))
        session = session_of(ctx, self.instance)
        if self.workspaces is not None and session is not None:
            listing = await anyio.to_thread.run_sync(session_entries, self.workspaces, session, tenant)
            found |= {u: types.Resource(uri=u, name=n, mime_type=m, size=size) for u, n, m, size in listing}
        for service in self.services.of_caller(identity_of(ctx).limits_key) if self.services is not None else []:
            uri = f"{SERVICE_PREFIX}{service.id}"
            found[uri] = types.Resource(uri=uri, name=f"service {service.name}", mime_type="application/json")
        page, next_cursor = page_of(list(found), params.cursor if params else None, RESOURCES_PAGE)
        return types.ListResourcesResult(resources=[found[uri] for uri in page], next_cursor=next_cursor)

    async def templates(
        self, ctx: Context, params: types.PaginatedRequestParams | None
    ) -> types.ListResourceTemplatesResult:
        kept = types.ResourceTemplate(
            uri_template=RESOURCE_TEMPLATE,
            name="workspace-file",
            title="A file in a kept workspace or snapshot",
            description="A file of the workspace a tool result named in `structuredContent.workspace`, or of a "
            "snapshot: {workspace} is its id or the name its caller gave it (the `workspaces` tool).",
        )
        listing = types.ResourceTemplate(
            uri_template=LISTING_TEMPLATE,
            name="workspace-files",
            title="The files of a kept workspace or snapshot",
            description="The files of the workspace a tool result named in `structuredContent.workspace`, or of a "
            "snapshot ({workspace}: its id or name), as JSON: each file's path, size, MIME type and URI.",
            mime_type="application/json",
        )
        templates = [kept, listing]
        if self._task_output is not None:
            templates.append(
                types.ResourceTemplate(
                    uri_template=OUTPUT_TEMPLATE,
                    name="task-output",
                    title="A task's output so far",
                    description="The stdout and stderr of a task of yours, read while it runs or after it ended "
                    "(the beginning and the end when it printed more than the policy's limits.output_bytes).",
                    mime_type="text/plain",
                )
            )
        if self.services is not None:
            templates.append(
                types.ResourceTemplate(
                    uri_template=SERVICE_PREFIX + "{id}",
                    name="service",
                    title="A service of yours",
                    description="A running service's state, port, address, uptime and the last lines of its log, "
                    "as JSON (its id is in the answer that started it).",
                    mime_type="application/json",
                )
            )
        return types.ListResourceTemplatesResult(resource_templates=templates)

    async def read(self, ctx: Context, params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
        uri = str(params.uri)
        if self._task_output is not None and uri.startswith("sandbox://tasks/"):
            output = await self._task_output(ctx, uri)
            if output is None:
                code = RESOURCE_NOT_FOUND_HANDSHAKE if handshake_era(ctx) else INVALID_PARAMS
                raise MCPError(code, f"resource not found: {uri} (a task's output is its own caller's, kept as long "
                               "as the task)")  # fmt: skip
            return output
        if self.services is not None and uri.startswith(SERVICE_PREFIX):
            return await self._service(ctx, uri)
        try:
            base, part = requested_part(uri, READ_PART_BYTES)
        except ValueError as exc:
            raise MCPError(INVALID_PARAMS, str(exc)) from None
        tenant, session = identity_of(ctx).tenant, session_of(ctx, self.instance)
        listed = listing_id(base) if part is None else None
        if listed is not None:
            listing = await anyio.to_thread.run_sync(self._listing, uri, listed, session, tenant)
            if listing is not None:
                return listing
        offset, length = part or (0, READ_PART_BYTES)
        found = await anyio.to_thread.run_sync(self._file, base, session, tenant, offset, length)
        if found is None:
            code = RESOURCE_NOT_FOUND_HANDSHAKE if handshake_era(ctx) else INVALID_PARAMS
            raise MCPError(code, f"resource not found: {base} (files are kept for a while, then dropped)")
        mime, size, content = found
        if part is not None:  # one part, as bytes, with where the next one starts
            following = offset + len(content)
            meta: dict[str, Any] = {"offset": offset, "length": len(content), "size": size}
            meta["next"] = f"{base}?offset={following}" if following < size else None
            blob = base64.b64encode(content).decode()
            piece = types.BlobResourceContents(uri=uri, mime_type=mime, blob=blob, _meta={PART_META: meta})
            return types.ReadResourceResult(contents=[piece])
        if size > READ_PART_BYTES:
            raise MCPError(
                INVALID_PARAMS,
                f"{base} is {size} bytes, more than one read returns ({READ_PART_BYTES} bytes, so that an answer "
                f"fits the 1 MiB message a client accepts); read it in parts: {base}?offset=0, then "
                f"?offset={READ_PART_BYTES} and so on (each part's _meta[{PART_META!r}] names the next)",
            )
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError:
            blob = base64.b64encode(content).decode()
            item: Any = types.BlobResourceContents(uri=uri, mime_type=mime, blob=blob)
        else:
            item = types.TextResourceContents(uri=uri, mime_type=mime, text=text)
        return types.ReadResourceResult(contents=[item])

    async def _service(self, ctx: Context, uri: str) -> types.ReadResourceResult:
        """A running service of the caller's, with the end of its log; not found for everyone else."""
        assert self.services is not None
        service = self.services.find(uri.removeprefix(SERVICE_PREFIX), identity_of(ctx).limits_key)
        if service is None:
            code = RESOURCE_NOT_FOUND_HANDSHAKE if handshake_era(ctx) else INVALID_PARAMS
            raise MCPError(code, f"resource not found: {uri} (a service is its own caller's, while it runs)")
        log = await anyio.to_thread.run_sync(self.services.maker.log_of, service)
        described = {**service.describe(self.services.links.link(service)), "log_tail": log}
        text = json.dumps(described, ensure_ascii=False)
        return types.ReadResourceResult(
            contents=[types.TextResourceContents(uri=uri, mime_type="application/json", text=text)]
        )

    def _listing(
        self, uri: str, workspace_id: str, session: str | None, tenant: str | None
    ) -> types.ReadResourceResult | None:
        """A kept workspace's files, as JSON, when this caller may see the workspace (else None: not found)."""
        record = None if self.workspaces is None else self.workspaces.find(workspace_id, session, tenant)
        if self.workspaces is None or record is None:
            return None
        listing: dict[str, Any] = {"workspace": workspace_id, "files": workspace_listing(self.workspaces, record)}
        last = self.workspaces.last_changes.of(record.id)
        if last is not None:
            listing["last_call_changes"] = last
        text = json.dumps(listing, ensure_ascii=False)
        return types.ReadResourceResult(
            contents=[types.TextResourceContents(uri=uri, mime_type="application/json", text=text)]
        )

    def _file(
        self, uri: str, session: str | None, tenant: str | None, offset: int, length: int
    ) -> tuple[str, int, bytes] | None:
        """A kept output or workspace file the tenant may read: (MIME type, its size, `length` bytes from `offset`)."""
        kept = self.store.get(uri, tenant)
        if kept is None and self.shared_files is not None and uri.startswith("sandbox://calls/"):
            kept = self.shared_files.get(uri, tenant)  # another replica's call (this runs in a worker thread)
        if kept is not None:
            return kept[0], len(kept[1]), kept[1][offset : offset + length]
        if self.workspaces is None:
            return None
        if uri.startswith(EXPORT_PREFIX):
            return self.workspaces.exports.read(uri, tenant, offset, length)
        try:
            limit = self._policy().default.limits.returned_file_bytes
            return read_workspace_file(self.workspaces, uri, session, limit, tenant, (offset, length))
        except Refusal as refusal:
            raise MCPError(INVALID_PARAMS, refusal.message) from None
