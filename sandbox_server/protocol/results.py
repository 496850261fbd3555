"""ToolOutcome -> MCP content blocks, as plain JSON-shaped dicts (the protocol's server makes them models).

Text is sanitised for a model and a terminal: escape sequences removed, control
characters replaced, bidirectional overrides made visible. Files come back as
images, embedded text or blobs, or, when large, as resource links served by
`ResourceStore` through resources/read.
"""

from __future__ import annotations

import base64
import functools
import json
import mimetypes
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote

from sandbox_server.protocol.meta import PATH_META
from sandbox_server.sandbox.spec import OutputFile
from sandbox_server.sandbox.streams import WHOLE_BYTES
from sandbox_server.tools.base import ToolOutcome

__all__ = ["RenderedResult", "ResourceStore", "render", "sanitize"]

_ESCAPES = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor moves, clear screen
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC: titles, hyperlinks, clipboard (52)
    r"|\x1b[PX^_][^\x1b]*(?:\x1b\\)?"  # DCS, SOS, PM, APC strings
    r"|\x1b[@-Z\\-_]?"  # other two-byte escapes, or a lone ESC
    r"|\x9b[0-?]*[ -/]*[@-~]"  # 8-bit CSI
)
_CONTROLS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_INVISIBLE = re.compile(r"[\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")

EMBED_TEXT_BYTES = 64 * 1024
EMBED_BLOB_BYTES = 256 * 1024
IMAGE_TYPES = {b"\x89PNG\r\n\x1a\n": "image/png", b"\xff\xd8\xff": "image/jpeg", b"GIF8": "image/gif"}
AUDIO_TYPES = {b"OggS": "audio/ogg", b"fLaC": "audio/flac", b"ID3": "audio/mpeg", b"\xff\xfb": "audio/mpeg"}
"""Audio by its first bytes; a WAV file is RIFF with WAVE at byte 8 (`_mime_type` knows it so)."""


def sanitize(text: str) -> str:
    """Text safe to show a model or a terminal: no escapes, no controls, visible bidi marks."""
    text = _ESCAPES.sub("", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROLS.sub("\ufffd", text)
    return _INVISIBLE.sub(lambda match: f"<U+{ord(match.group()):04X}>", text)


class ResourceStore:
    """Files too large to embed, readable through resources/read; oldest dropped past the caps.

    A file is kept for its tenant (an authenticated caller, an anonymous session or caller) and is
    that tenant's alone: to anyone else it does not exist. Each tenant may hold `max_bytes_per_tenant`
    (its own oldest files make room for its new ones); when all of them together pass `max_bytes`,
    the tenant holding the most gives up its oldest, so one caller's many files never push out another's.
    """

    def __init__(self, max_bytes: int = 256 * 1024 * 1024, max_bytes_per_tenant: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.max_bytes_per_tenant = max_bytes_per_tenant or max_bytes // 4
        self._items: OrderedDict[str, tuple[str, bytes, str | None]] = OrderedDict()
        self._used = 0
        self._used_by: dict[str | None, int] = {}
        self._lock = threading.Lock()

    def put(self, uri: str, mime_type: str, content: bytes, tenant: str | None = None) -> None:
        """Keep a file under its URI, for its tenant (None: for whoever holds the URI)."""
        with self._lock:
            self._drop(uri)
            self._items[uri] = (mime_type, content, tenant)
            self._used += len(content)
            self._used_by[tenant] = self._used_by.get(tenant, 0) + len(content)
            for older in self._older_of(tenant, uri):  # its own oldest first, never the file just kept
                if self._used_by.get(tenant, 0) <= self.max_bytes_per_tenant:
                    break
                self._drop(older)
            while self._used > self.max_bytes and len(self._items) > 1:
                largest = max(self._used_by, key=self._used_by.__getitem__)
                self._drop(next(iter(self._older_of(largest, uri)), None) or next(iter(self._items)))

    def _older_of(self, tenant: str | None, kept: str) -> list[str]:
        """A tenant's files, oldest first, but the one just kept."""
        return [u for u, item in self._items.items() if item[2] == tenant and u != kept]

    def _drop(self, uri: str) -> None:
        dropped = self._items.pop(uri, None)
        if dropped is not None:
            self._used -= len(dropped[1])
            self._used_by[dropped[2]] -= len(dropped[1])
            if not self._used_by[dropped[2]]:
                del self._used_by[dropped[2]]

    def get(self, uri: str, tenant: str | None = None) -> tuple[str, bytes] | None:
        """The MIME type and bytes of a file kept for this tenant, or None."""
        with self._lock:
            found = self._items.get(uri)
        return found[:2] if found is not None and found[2] == tenant else None

    def uris(self, tenant: str | None = None) -> list[str]:
        """Every URI kept for this tenant, oldest first."""
        with self._lock:
            return [uri for uri, (_, _, kept_for) in self._items.items() if kept_for == tenant]


@dataclass(frozen=True, slots=True)
class RenderedResult:
    """A CallToolResult as JSON-shaped parts."""

    content: list[dict[str, Any]]
    structured: dict[str, Any] | None
    is_error: bool


def _mime_type(file: OutputFile) -> str:
    """An image or audio type only when the bytes are one (whatever the name says); otherwise a guess by name."""
    for magic, mime in (*IMAGE_TYPES.items(), *AUDIO_TYPES.items()):
        if file.content.startswith(magic):
            return mime
    if file.content[:4] == b"RIFF" and file.content[8:12] == b"WAVE":
        return "audio/wav"
    guessed, _ = mimetypes.guess_type(file.path)
    if guessed is None or guessed.startswith(("image/", "audio/")) and guessed != "image/svg+xml":
        return "application/octet-stream"
    return guessed


def _file_block(
    file: OutputFile, uri: str, store: ResourceStore, tenant: str | None, kept: list[Any] | None = None
) -> dict[str, Any]:
    """A returned file as a content block; every one is also kept for resources/read under its URI (bounded)."""
    mime = _mime_type(file)
    store.put(uri, mime, file.content, tenant)
    if kept is not None:
        kept.append((uri, mime, file.content, tenant))
    media = "image" if mime in IMAGE_TYPES.values() else "audio" if mime.startswith("audio/") else None
    if media is not None and len(file.content) <= EMBED_BLOB_BYTES * 8:
        data = base64.b64encode(file.content).decode()
        return {"type": media, "data": data, "mimeType": mime, "_meta": {PATH_META: sanitize(file.path)}}
    try:
        text = file.content.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and len(file.content) <= EMBED_TEXT_BYTES:
        if mime == "application/octet-stream":
            mime = "text/plain"
        return {"type": "resource", "resource": {"uri": uri, "mimeType": mime, "text": text}}
    if text is None and len(file.content) <= EMBED_BLOB_BYTES:
        blob = base64.b64encode(file.content).decode()
        return {"type": "resource", "resource": {"uri": uri, "mimeType": mime, "blob": blob}}
    return {
        "type": "resource_link",
        "uri": uri,
        "name": sanitize(file.path),
        "mimeType": mime,
        "size": len(file.content),
        "description": "too large to embed; read it with resources/read",
    }


def unplaced(text: str, folders: Sequence[str]) -> str:
    """The server's own words with no path into the host's `folders` (its state, its sandboxes' bundles): each
    such path, to its end, is said as a folder of the server (an error the system or the engine raised names one)."""
    pattern = _paths_into(tuple(folders))
    return pattern.sub("<a folder of the server>", text) if pattern is not None else text


@functools.cache
def _paths_into(folders: tuple[str, ...]) -> re.Pattern[str] | None:
    """One pattern for a path into any of `folders` (the longest first), made once per set of folders."""
    kept = sorted({f.rstrip("/") for f in folders if len(f.rstrip("/")) > 1}, key=len, reverse=True)
    if not kept:
        return None
    return re.compile("(?:" + "|".join(map(re.escape, kept)) + r")(?![^/\s'\"])[^\s'\"]*")


def render(
    outcome: ToolOutcome,
    store: ResourceStore,
    max_images: int = 8,
    max_image_bytes: int = 4_000_000,
    tenant: str | None = None,
    kept: list[Any] | None = None,
    host_folders: Sequence[str] = (),
) -> RenderedResult:
    """The blocks a client receives: text first, then structured JSON, images and files (large ones kept for `tenant`);
    `kept` hears of every file kept (uri, MIME type, bytes, tenant), for replicas to keep them too. What the server
    says itself (the headline, the notes, an error's message) names no path into `host_folders`."""
    if host_folders:
        outcome = _unplaced_outcome(outcome, host_folders)
    lines = [sanitize(outcome.headline)]
    for title, body in outcome.sections:
        if body or title == "stdout":
            lines.append(f"--- {title} ---")
            lines.append(sanitize(body).rstrip("\n") or "(empty)")
    for note in outcome.notes:
        lines.append(f"note: {sanitize(note)}")
    content: list[dict[str, Any]] = [{"type": "text", "text": "\n".join(lines)}]
    structured = None
    if outcome.structured is not None:
        answer = outcome.structured if outcome.view is None else {**outcome.structured, "view": outcome.view}
        structured = json.loads(json.dumps(answer))
        for key in ("stdout", "stderr"):
            if isinstance(structured.get(key), str):
                structured[key] = sanitize(structured[key])
        content.append({"type": "text", "text": ""})  # the JSON, once the files' URIs are known
    call_id = uuid.uuid4().hex[:12]
    images = image_bytes = 0
    skipped = []
    uris: dict[str, str] = {}
    for file in outcome.files:
        if _mime_type(file) in IMAGE_TYPES.values():
            if images >= max_images or image_bytes + file.size > max_image_bytes:
                skipped.append(
                    f"note: {sanitize(file.path)}: image not returned, over the images budget "
                    f"({max_images} images, {max_image_bytes} bytes; policy fields "
                    "limits.returned_images, limits.returned_image_bytes)"
                )
                continue
            images += 1
            image_bytes += file.size
        uris[file.path] = f"sandbox://calls/{call_id}/out/{quote(file.path, safe='/')}"
        content.append(_file_block(file, uris[file.path], store, tenant, kept))
    for name, whole in outcome.outputs:  # a stream the answer cut, kept whole
        uri = f"sandbox://calls/{call_id}/{name}"
        store.put(uri, "text/plain", whole, tenant)
        if kept is not None:
            kept.append((uri, "text/plain", whole, tenant))
        skipped.append(
            f"note: the whole {name} ({len(whole)} bytes{', its first 8 MiB' if len(whole) >= WHOLE_BYTES else ''}) "
            f"is kept at {uri}: read it with resources/read, in parts from {uri}?offset=0"
        )
        content.append({"type": "resource_link", "uri": uri, "name": f"the whole {name}", "mimeType": "text/plain",
                        "size": len(whole), "description": f"{name} as it came; the answer shows its start and end"})  # fmt: skip
    if skipped:
        content[0]["text"] += "\n" + "\n".join(skipped)
    started = (outcome.structured or {}).get("service")
    if isinstance(started, dict) and started.get("preview"):  # the signed link its caller opens it with
        content.append(
            {
                "type": "resource_link",
                "uri": started["preview"],
                "name": f"preview of service {started['name']}",
                "mimeType": "text/html",
                "description": "opens the service in its caller's browser: good once, for a few minutes",
            }
        )
    if structured is not None:
        for item in structured.get("files", []):
            if item.get("path") in uris:
                item["uri"] = uris[item["path"]]
            item["path"] = sanitize(item["path"])
        content[1]["text"] = json.dumps(_without_repeats(structured), ensure_ascii=False)
    return RenderedResult(content=content, structured=structured, is_error=outcome.is_error)


def _unplaced_outcome(outcome: ToolOutcome, folders: Sequence[str]) -> ToolOutcome:
    structured = outcome.structured
    error = (structured or {}).get("error")
    if structured is not None and isinstance(error, dict) and isinstance(error.get("message"), str):
        structured = {**structured, "error": {**error, "message": unplaced(error["message"], folders)}}
    return replace(
        outcome,
        headline=unplaced(outcome.headline, folders),
        notes=tuple(unplaced(note, folders) for note in outcome.notes),
        structured=structured,
    )


def _without_repeats(structured: dict[str, Any]) -> dict[str, Any]:
    """The structured result as the JSON text block carries it: stdout and stderr, already in the first text
    block, are named there rather than repeated (a result never carries the same output twice)."""
    echo = dict(structured)
    for key in ("stdout", "stderr"):
        if isinstance(echo.get(key), str) and echo[key]:
            echo[key] = f"<{len(echo[key])} characters: the --- {key} --- section of the first text block>"
    return echo
