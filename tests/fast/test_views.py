"""The views as shipped: self-contained, small, and unable to reach anything but their host; linked only for
clients that negotiated them."""

from __future__ import annotations

import re
from typing import Any

import pytest

from sandbox_server.policy.loader import load_policy
from sandbox_server.protocol.apps import APP_MIME_TYPE, VIEW_PREFIX, VIEWS, Views, page, tool_ui
from sandbox_server.protocol.listing import tool_model
from sandbox_server.tools import all_tools

PAGE_BUDGET = 24_000
"""The most characters one view may take, script and style included: small enough to read whole."""


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_a_view_is_one_small_document_that_fetches_nothing_and_builds_no_markup_from_data(view: str) -> None:
    text = page(view)
    assert "/* bridge.js */" not in text and "/* view.css */" not in text  # both inlined
    assert len(text) <= PAGE_BUDGET, len(text)
    assert not re.search(r"""(src|href)\s*=\s*["'](?!#)""", text), "a static address: the page fetches something"
    assert not re.search(r"@import|url\(|<link\b", text), "a style that fetches"
    for reach in ("fetch(", "XMLHttpRequest", "WebSocket", "EventSource", "sendBeacon", "importScripts"):
        assert reach not in text, reach  # every request goes through the host, as MCP
    for unsafe in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert unsafe not in text, unsafe  # data becomes text, never markup or code


def test_a_view_is_read_as_an_app_with_what_its_host_must_allow() -> None:
    views = Views("http://127.0.0.1:8080")
    read = views.read(VIEW_PREFIX + "service")
    assert read is not None
    [contents] = read.contents
    assert contents.mime_type == APP_MIME_TYPE
    assert contents.meta == {"ui": {"prefersBorder": True, "csp": {"frameDomains": ["http://127.0.0.1:8080"]}}}
    table = views.read(VIEW_PREFIX + "table")
    assert table is not None and table.contents[0].meta == {"ui": {"prefersBorder": True}}
    assert Views(None).read(VIEW_PREFIX + "service").contents[0].meta == {"ui": {"prefersBorder": True}}  # type: ignore[union-attr]
    assert views.read(VIEW_PREFIX + "nope") is None and views.read("sandbox://workspace/x/") is None
    assert {str(r.uri) for r in views.listed()} == {VIEW_PREFIX + v for v in VIEWS}


def test_only_a_client_that_negotiated_views_sees_a_tool_linked_to_its_view() -> None:
    policy = load_policy("default", [t.name for t in all_tools()])
    for tool in all_tools():
        plain = tool_model(tool.name, tool, policy)
        assert "ui" not in (plain.meta or {}) and "view" not in (plain.output_schema or {})["properties"]
        ui = tool_ui(tool.name)
        linked = tool_model(tool.name, tool, policy, ui=ui)
        if ui is None:
            assert linked == plain
            continue
        assert (linked.meta or {})["ui"] == {"resourceUri": ui["resourceUri"]}
        assert ui["resourceUri"].removeprefix(VIEW_PREFIX) in VIEWS
        assert (linked.output_schema or {})["properties"]["view"]["type"] == "object"
        assert linked.model_dump(exclude={"meta", "output_schema"}) == plain.model_dump(
            exclude={"meta", "output_schema"}
        )


def test_previews_say_who_may_frame_them_and_refuse_what_is_not_an_origin() -> None:
    from sandbox_server.errors import UsageError
    from sandbox_server.protocol.preview import Previews

    services: Any = None
    assert Previews(services, ["127.0.0.1"]).framing == "frame-ancestors 'self'"
    named = Previews(services, ["127.0.0.1"], ["https://app.example/", "http://127.0.0.1:*"])
    assert named.framing == "frame-ancestors 'self' https://app.example http://127.0.0.1:*"
    for wrong in ("app.example", "javascript:alert(1)", "https://app.example/page", "*"):
        with pytest.raises(UsageError, match="is not an origin"):
            Previews(services, ["127.0.0.1"], [wrong])
