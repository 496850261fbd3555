"""Where a listing or a read resumes: opaque list cursors, and the `?offset=` part of a resource URI."""

from __future__ import annotations

import base64
import binascii

__all__ = ["paginate", "requested_part"]


def paginate(names: list[str], cursor: str | None, page_size: int) -> tuple[list[str], str | None]:
    """One page of names from an opaque cursor, and the cursor of the next page; ValueError for a bad cursor."""
    start = 0
    if cursor is not None:
        try:
            start = int(base64.urlsafe_b64decode(cursor.encode()).decode().removeprefix("offset:"))
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise ValueError(cursor) from exc
        if not 0 < start < len(names):
            raise ValueError(cursor)
    page = names[start : start + page_size]
    end = start + len(page)
    return page, base64.urlsafe_b64encode(f"offset:{end}".encode()).decode() if end < len(names) else None


def requested_part(uri: str, most: int) -> tuple[str, tuple[int, int] | None]:
    """A resource URI without its `?offset=N[&length=M]`, and that part (None: the whole file); ValueError when
    the query is not one. A name's own `?` is always percent-encoded in the URIs the server gives."""
    base, mark, query = uri.partition("?")
    if not mark:
        return uri, None
    fields = dict(part.partition("=")[::2] for part in query.split("&") if part)
    unknown = set(fields) - {"offset", "length"}
    if unknown or "offset" not in fields:
        raise ValueError(f"{uri}: a part of a file is asked for as ?offset=N (and at most &length=M), bytes from 0")
    try:
        offset, length = int(fields["offset"]), int(fields.get("length", most))
    except ValueError:
        raise ValueError(f"{uri}: offset and length are whole numbers of bytes") from None
    if offset < 0 or not 0 < length <= most:
        raise ValueError(f"{uri}: offset must be 0 or more, and length between 1 and {most}")
    return base, (offset, length)
