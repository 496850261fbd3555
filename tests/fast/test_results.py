"""Pure logic of rendering: sanitising text and choosing how files come back."""

import base64

from sandbox_server.protocol.results import ResourceStore, render, sanitize
from sandbox_server.sandbox.spec import OutputFile
from sandbox_server.tools.base import ToolOutcome


def test_sanitize_removes_escapes_and_controls() -> None:
    hostile = "a\x1b[2Jb\x1b]52;c;ZXZpbA==\x07c\x1b]8;;http://x\x1b\\d\x00e\x7ff\r\ng\rh\x9b31m"
    assert sanitize(hostile) == "abcd\ufffde\ufffdf\ng\nh"


def test_sanitize_makes_bidi_overrides_visible() -> None:
    assert sanitize("safe\u202etxt.exe") == "safe<U+202E>txt.exe"


def test_render_puts_the_headline_first_and_structured_json_second() -> None:
    outcome = ToolOutcome("exit code 0", False, (("stdout", "hi\n"),), {"stdout": "hi\n"})
    rendered = render(outcome, ResourceStore())
    assert rendered.content[0]["text"].splitlines()[0] == "exit code 0"
    assert (
        rendered.content[1]["text"]
        == '{"stdout": "<3 characters: the --- stdout --- section of the first text block>"}'
    )
    assert rendered.structured == {"stdout": "hi\n"}


def test_files_become_images_resources_blobs_or_links() -> None:
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 10
    files = (
        OutputFile("plot.png", png, len(png)),
        OutputFile("a.txt", b"text", 4),
        OutputFile("b.bin", b"\xff\xfe\x00", 3),
        OutputFile("big.txt", b"x" * 200_000, 200_000),
    )
    store = ResourceStore()
    rendered = render(ToolOutcome("ok", False, files=files), store)
    kinds = [block["type"] for block in rendered.content[1:]]
    assert kinds == ["image", "resource", "resource", "resource_link"]
    assert base64.b64decode(rendered.content[1]["data"]) == png
    assert rendered.content[2]["resource"]["text"] == "text"
    assert base64.b64decode(rendered.content[3]["resource"]["blob"]) == b"\xff\xfe\x00"
    link = rendered.content[4]
    assert store.get(link["uri"]) == ("text/plain", b"x" * 200_000)


def test_resource_store_drops_the_oldest_past_its_cap() -> None:
    store = ResourceStore(max_bytes=10)
    store.put("a", "text/plain", b"123456")
    store.put("b", "text/plain", b"123456")
    assert store.get("a") is None and store.get("b") is not None


def test_one_tenants_many_files_never_push_out_anothers() -> None:
    store = ResourceStore(max_bytes=100, max_bytes_per_tenant=30)
    store.put("honest", "text/plain", b"h" * 20, tenant="alice")
    for number in range(34):
        store.put(f"flood-{number}", "text/plain", b"f" * 10, tenant="mallory")
    assert store.get("honest", "alice") is not None
    assert store.uris("mallory") == ["flood-31", "flood-32", "flood-33"]
    for number in range(4):  # past the whole store's cap: the tenant holding the most gives way
        store.put(f"other-{number}", "text/plain", b"o" * 25, tenant=f"caller-{number}")
    assert store.get("honest", "alice") is not None and store.get("other-3", "caller-3") is not None
    assert len(store.uris("mallory")) < 3


def test_a_file_kept_for_a_caller_is_theirs_alone() -> None:
    store = ResourceStore()
    link = render(
        ToolOutcome("ok", False, files=(OutputFile("big.txt", b"x" * 200_000, 200_000),)), store, tenant="alice"
    )
    uri = link.content[1]["uri"]
    assert store.get(uri, "alice") == ("text/plain", b"x" * 200_000) and store.uris("alice") == [uri]
    assert store.get(uri, "bob") is None and store.get(uri) is None and store.uris("bob") == store.uris() == []


def test_images_beyond_the_budget_are_listed_not_returned() -> None:
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 100
    files = tuple(OutputFile(f"p{i}.png", png, len(png)) for i in range(3))
    rendered = render(ToolOutcome("ok", False, files=files), ResourceStore(), max_images=2)
    assert [block["type"] for block in rendered.content] == ["text", "image", "image"]
    assert "p2.png: image not returned, over the images budget" in rendered.content[0]["text"]


def test_a_file_is_an_image_by_its_bytes_not_its_name() -> None:
    files = (
        OutputFile("empty.png", b"", 0),
        OutputFile("fake.jpg", b"not a jpeg", 10),
        OutputFile("real.dat", b"GIF89a" + b"\0" * 10, 16),
    )
    rendered = render(ToolOutcome("ok", False, files=files), ResourceStore(), max_images=1)
    blocks = rendered.content[1:]
    assert [block["type"] for block in blocks] == ["resource", "resource", "image"]
    assert blocks[0]["resource"]["mimeType"] == blocks[1]["resource"]["mimeType"] == "text/plain"
    assert blocks[2]["mimeType"] == "image/gif"
    assert "budget" not in rendered.content[0]["text"]
