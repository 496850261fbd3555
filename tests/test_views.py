"""MCP Apps views, rendered by a real host against the real server.

The host (tests/apps_host) is the official AppBridge of @modelcontextprotocol/ext-apps in Debian's headless Chromium,
driven through playwright-core; its MCP client is the official TypeScript one over Streamable HTTP, declaring the
Apps extension. It frames each view as hosts do (a sandboxed iframe whose Content-Security-Policy allows nothing
but the document's own inline script and style and data: images), so a view that fetched anything from anywhere
would be refused, and the test would see the refusal. The views are looked at: screenshots are checked by their
pixels, and a person's actions (sorting, filtering, hovering a bar, zooming a series, cancelling a task, opening a
file, a preview) are taken and their effects read back.

A client without the extension is checked to get exactly what it got before views existed.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mcp_types as types
import numpy as np
import pandas as pd
import pytest
from mcp.client.extension import ClientExtension
from mcp.server.apps import APP_MIME_TYPE, EXTENSION_ID
from mcp.shared.exceptions import MCPError
from PIL import Image

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.conftest import run_cli
from tests.mcp_harness import audit_records, connect, free_port, http_server_process, upload

HOST = Path(__file__).parent / "apps_host"
NODE = HOST / "node_modules" / ".bin" / "node"
"""The Node.js the lock file pins, not the host's."""
ACCENT = (47, 111, 222)
"""The views' accent: bars and points of a chart."""
CHANGED = (255, 244, 194)
"""The background of a file the last call changed."""
DANGER = (196, 50, 43)
"""What went wrong, or was stopped, is said in this color."""
CITIES = ["Zürich", "Göteborg", "Málaga"]
DAYS = 12


def weather() -> tuple[bytes, pd.DataFrame]:
    """A German-style CSV in Latin-1 (semicolons, decimal commas) of 12 days in 3 cities, and its rows."""
    rows = [
        {
            "Stadt": city,
            "Datum": f"2026-03-{day + 1:02d}",
            "Temperatur": round(4 + 7 * i + 3 * math.sin(day + 2 * i), 2),
            "Regen": (day * (i + 2)) % 7,
        }
        for day in range(DAYS)
        for i, city in enumerate(CITIES)
    ]
    lines = ["Stadt;Datum;Temperatur;Regen"]
    lines += [f"{r['Stadt']};{r['Datum']};{r['Temperatur']:.2f};{r['Regen']}".replace(".", ",") for r in rows]
    return ("\n".join(lines) + "\n").encode("latin-1"), pd.DataFrame(rows)


class Host:
    """The test host's process: one JSON command a line, one JSON answer a line."""

    def __init__(self, url: str, page_port: int) -> None:
        self.process = subprocess.Popen(
            [str(NODE), str(HOST / "host.mjs"), url, str(page_port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        first = self._line()
        assert first == {"ready": True}, first

    def _line(self) -> Any:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            stderr = self.process.stderr.read() if self.process.stderr is not None else ""
            raise AssertionError(f"the host ended: {stderr[-3000:]}")
        return json.loads(line)

    def __call__(self, cmd: str, **arguments: Any) -> Any:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"cmd": cmd, **arguments}) + "\n")
        self.process.stdin.flush()
        answer = self._line()
        assert "error" not in answer, answer["error"]
        return answer["ok"]

    def clean(self) -> None:
        """Nothing the browser refused to load, no error in any page."""
        seen = self("seen")
        assert seen["refused"] == [] and seen["errors"] == [], seen

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"cmd": "close"}) + "\n")
        self.process.stdin.flush()
        try:
            self.process.wait(timeout=60)
        finally:  # a host that does not end is ended
            self.process.kill()
            self.process.wait()
            for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
                if stream is not None:
                    stream.close()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, runtime: DockerRuntime, page_port: int
) -> Iterator[tuple[str, Path]]:
    """The server on its default policy, over Streamable HTTP (previews on), with its audit log; the host's page
    (at `page_port`) may frame its previews."""
    state = tmp_path_factory.mktemp("views")
    audit = state / "audit.jsonl"
    with http_server_process(
        "--state-dir", str(state / "s"), "--no-pool", "--audit-log", str(audit),
        "--frame-ancestor", f"http://127.0.0.1:{page_port}",
    ) as process:  # fmt: skip
        yield process.url, audit


@pytest.fixture(scope="module")
def page_port() -> int:
    """Where the host serves its page (the origin that may frame previews)."""
    return free_port()


@pytest.fixture(scope="module")
def host(server: tuple[str, Path], page_port: int) -> Iterator[Host]:
    """The host, installed from the npm registry as its lock file pins it, connected to the server."""
    if not (HOST / "node_modules" / "@modelcontextprotocol" / "ext-apps").is_dir() or not NODE.exists():
        done = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"], cwd=HOST, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
    running = Host(server[0], page_port)
    yield running
    running.close()


def number(text: str) -> float:
    return float(text.replace(",", ""))


SHOTS = os.environ.get("SANDBOX_VIEW_SHOTS")
"""A folder to keep the views' screenshots in (docs/views.md shows them: `SANDBOX_VIEW_SHOTS=docs/views scripts/run
test tests/test_views.py` makes them again); else each test's own folder."""


def shot_path(folder: Path, name: str) -> Path:
    """Where a view's screenshot is written: SANDBOX_VIEW_SHOTS when set, else the test's folder."""
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        return Path(SHOTS) / name
    return folder / name


def looked_at(path: str) -> np.ndarray:
    """A screenshot's pixels, rows by columns by RGB."""
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def near(pixel: np.ndarray, color: tuple[int, int, int], tolerance: int = 24) -> bool:
    return bool((np.abs(pixel - np.array(color)) <= tolerance).all())


def count(region: np.ndarray, color: tuple[int, int, int], tolerance: int) -> int:
    """Pixels of a region within `tolerance` of a color."""
    return int((np.abs(region - np.array(color)) <= tolerance).all(axis=2).sum())


def test_analyze_csv_view_sorts_filters_hovers_and_switches_the_statistic(host: Host, tmp_path: Path) -> None:
    content, frame = weather()
    means = frame.groupby("Stadt")["Temperatur"].mean()
    highs = frame.groupby("Stadt")["Temperatur"].max()
    arguments = {
        "filepath": "wetter.csv",
        "operations": ["average", "max", "sum"],
        "group_by": ["Stadt"],
        "files": upload("wetter.csv", content),
    }
    opened = host("open", tool="analyze_csv", arguments=arguments)
    assert opened["uri"] == "ui://sandbox-server/table"
    structured = opened["result"]["structuredContent"]
    host("wait", selector="body[data-ready]")

    # The findings beside the table, as the result found them: the file's encoding and how it writes numbers.
    facts = host("text", selector="#facts")[0]
    assert structured["file"]["encoding"] in facts
    assert structured["file"]["numbers"]["decimal"] == ","
    assert 'Decimal mark\n"," (detected)' in facts and 'Delimiter\n";"' in facts, facts

    # Sorting by a column, ascending then descending.
    headers = host("text", selector="#results thead th")
    column = headers.index("Temperatur · average") + 1
    host("click", selector=f"#results thead th >> nth={column - 1}")
    cells = [number(t) for t in host("text", selector=f"#results tbody td:nth-child({column})")]
    assert cells == pytest.approx(sorted(means.values), abs=1e-3)
    host("click", selector=f"#results thead th >> nth={column - 1}")
    cells = [number(t) for t in host("text", selector=f"#results tbody td:nth-child({column})")]
    assert cells == pytest.approx(sorted(means.values, reverse=True), abs=1e-3)

    # Filtering.
    host("fill", selector="#filter", value="rich")
    assert [row.split("\t")[0] for row in host("text", selector="#results tbody tr")] == ["Zürich"]
    assert host("text", selector="#count") == ["1 of 3 rows"]
    host("fill", selector="#filter", value="")

    # Hovering a bar shows its value.
    host("hover", selector="#chart rect.mark[data-label='Göteborg']")
    tip = host("text", selector="#tooltip")[0]
    label, value = tip.split(": ")
    assert label == "Göteborg" and number(value) == pytest.approx(means["Göteborg"], abs=1e-3)

    # Switching the statistic redraws the chart from the same result.
    host("select", selector="#stat", value="max")
    drawn = {label: float(v) for label, v in zip(*_marks(host), strict=True)}
    assert drawn == pytest.approx(highs.to_dict(), abs=1e-3)

    # Looked at: each bar is drawn, as tall as its value says, with the background above it.
    shot = looked_at(host("screenshot", path=str(shot_path(tmp_path, "table.png"))))
    boxes = host("boxes", selector="#chart rect.mark")
    for x, y, width, height in boxes:
        assert near(shot[int(y + height / 2), int(x + width / 2)], ACCENT), (x, y)
        assert not near(shot[int(y) - 4, int(x + width / 2)], ACCENT)
    heights = [box[3] for box in boxes]
    values = list(drawn.values())
    assert sorted(range(3), key=heights.__getitem__) == sorted(range(3), key=values.__getitem__)
    ink = int((shot[:40, :700].sum(axis=2) < 200).sum())
    assert ink > 200, "the title is not drawn"
    host.clean()


def test_analyze_csv_view_keeps_the_group_column_in_sight_while_the_others_scroll(host: Host) -> None:
    content, _ = weather()
    arguments = {
        "filepath": "wetter.csv", "operations": ["describe", "sum", "distinct", "nulls"], "group_by": ["Stadt"],
        "files": upload("wetter.csv", content),
    }  # fmt: skip
    host("open", tool="analyze_csv", arguments=arguments)
    host("wait", selector="body[data-ready]")
    assert len(host("text", selector="#results thead th")) >= 12  # wider than the view
    [(group_x, _, _, _), (second_x, _, _, _)] = host("boxes", selector="#results tbody tr >> nth=0 >> td")[:2]
    host("scroll", selector=".scroll", left=400)
    [(group_after, _, _, _), (second_after, _, _, _)] = host("boxes", selector="#results tbody tr >> nth=0 >> td")[:2]
    assert group_after == pytest.approx(group_x, abs=1), (group_x, group_after)  # stays in sight
    assert second_after < second_x - 100, (second_x, second_after)  # the others scrolled
    host.clean()


def _marks(host: Host) -> tuple[list[str], list[str]]:
    return host("attr", selector="#chart .mark", name="data-label"), host(
        "attr", selector="#chart .mark", name="data-value"
    )


def test_analyze_csv_view_zooms_a_time_series(host: Host) -> None:
    content, frame = weather()
    arguments = {
        "filepath": "wetter.csv",
        "operations": ["average"],
        "group_by": ["Datum"],
        "files": upload("wetter.csv", content),
    }
    host("open", tool="analyze_csv", arguments=arguments)
    host("wait", selector="body[data-ready]")
    labels, values = _marks(host)
    daily = frame.groupby("Datum")["Temperatur"].mean()
    assert labels == list(daily.index)  # a series: points in date order
    assert [float(v) for v in values] == pytest.approx(list(daily.values), abs=1e-3)
    assert host("attr", selector="#chart circle.mark", name="r") == ["4"] * DAYS
    host("drag", selector="#chart", **{"from": 0.35, "to": 0.75})
    zoomed, _ = _marks(host)
    assert 2 <= len(zoomed) < DAYS and labels[labels.index(zoomed[0]) :][: len(zoomed)] == zoomed, zoomed
    assert host("text", selector="#zoom") == [f"{len(zoomed)} of {DAYS} points"]
    host("click", selector="#reset")
    assert _marks(host)[0] == labels
    host.clean()


def test_run_python_view_shows_the_cell_as_a_notebook_does(host: Host, tmp_path: Path) -> None:
    code = (
        "import pandas as pd\nimport matplotlib.pyplot as plt\n"
        "n = 42\n"
        "df = pd.DataFrame({'city': ['Oslo', 'Lima', 'Pune'], 'temp': [3.5, 19.0, 27.25]})\n"
        "plt.bar(df.city, df.temp, color='#d62728')\n"
        "print('three cities')\n"
        "df"
    )
    opened = host("open", tool="run_python", arguments={"code": code})
    assert opened["uri"] == "ui://sandbox-server/cell"
    host("wait", selector="body[data-ready]")
    assert host("text", selector="#code")[0] == code
    assert [t.rstrip("\n") for t in host("text", selector="#stdout")] == [
        "three cities"
    ]  # the value is shown as a table, not again as text
    assert host("text", selector="#value tbody tr") == ["0\tOslo\t3.5", "1\tLima\t19", "2\tPune\t27.25"]
    kept = dict(row.split("\t") for row in host("text", selector="#kept tbody tr"))
    assert kept == {"n": "int 42", "df": "DataFrame 3 x 2"}, kept
    shot = looked_at(host("screenshot", path=str(shot_path(tmp_path, "cell.png"))))
    [(x, y, width, height)] = host("boxes", selector="img.figure")
    red = count(shot[int(y) : int(y + height), int(x) : int(x + width)], (214, 39, 40), 30)
    assert red > 2000, f"the figure's bars are not drawn ({red} red pixels)"
    host.clean()


def test_task_view_follows_a_running_task_and_cancels_it(host: Host, server: tuple[str, Path], tmp_path: Path) -> None:
    command = "for i in $(seq 1 300); do echo step $i; sleep 0.2; done"
    opened = host("open", tool="execute_command", arguments={"command": command, "timeout_s": 120}, task=True)
    assert opened["uri"] == "ui://sandbox-server/task" and opened["kind"] == "task"
    host("wait", selector="#log", text="step 3")
    assert host("text", selector="#state") == ["working"]
    assert host("text", selector="#elapsed")[0].endswith(" s")
    [task] = host("attr", selector="body", name="data-task")
    host("click", selector="#cancel")
    host("wait", selector="body[data-state=cancelled]")
    assert host("settled") == {"cancelled": True}
    shot = looked_at(host("screenshot", path=str(shot_path(tmp_path, "task.png"))))
    [(x, y, width, height)] = host("boxes", selector="#state")
    assert count(shot[int(y) : int(y + height), int(x) : int(x + width)], DANGER, 40) > 40  # said in red
    [(x, y, width, height)] = host("boxes", selector="#log")
    assert int((shot[int(y) : int(y + height), int(x) : int(x + width)].sum(axis=2) < 250).sum()) > 100  # the log
    seen = host("seen")
    assert {"name": "tasks", "arguments": {"action": "cancel", "task": task}} in seen["calls"]
    listed = host("call", tool="tasks", arguments={"action": "list"})["structuredContent"]["tasks"]
    assert [t["status"] for t in listed if t["id"] == task] == ["cancelled"]
    steps = [line for line in host("text", selector="#log")[0].splitlines() if line.startswith("step ")]
    assert 3 <= len(steps) < 300
    [cancelled] = [r for r in audit_records(server[1]) if r.get("tool") == "tasks" and r["action"] == "cancel"]
    assert cancelled["task"] == task and cancelled["outcome"] == "ok", cancelled
    assert cancelled["client"].startswith("apps-test-host/"), cancelled
    host.clean()


def test_files_view_lists_the_workspace_highlights_the_last_call_and_downloads(host: Host, tmp_path: Path) -> None:
    host("call", tool="execute_command", arguments={"command": "mkdir -p site && echo data > notes.txt"})
    host("call", tool="run_python", arguments={"code": "open('out.csv', 'w').write('a\\n1\\n')"})
    opened = host("open", tool="workspaces", arguments={"action": "list"})
    assert opened["uri"] == "ui://sandbox-server/files"
    host("wait", selector="body[data-ready]")
    paths = host("attr", selector="#files tbody tr", name="data-path")
    assert {"notes.txt", "out.csv"} <= set(paths)
    assert host("attr", selector="#files tbody tr.changed", name="data-path") == ["out.csv"]
    assert host("text", selector="#changes") == ["Its last call (highlighted) created: out.csv"]
    shot = looked_at(host("screenshot", path=str(shot_path(tmp_path, "files.png"))))
    [(x, y, width, height)] = host("boxes", selector="#files tbody tr.changed")
    assert near(shot[int(y + 3), int(x + width - 30)], CHANGED, 8)
    [(x, y, width, height)] = host("boxes", selector="#files tbody tr[data-path='notes.txt']")
    assert not near(shot[int(y + 3), int(x + width - 30)], CHANGED, 8)
    host("click", selector="#files tbody tr[data-path='notes.txt'] button")
    host("wait", selector="#note", text="handed to the host")
    [download] = host("seen")["downloads"]
    [embedded] = download["contents"]
    assert embedded["type"] == "resource" and embedded["resource"]["text"] == "data\n", embedded

    # Times say their zone: UTC when the host gives none, else the host's (Tokyo: nine hours on).
    [utc] = host("text", selector="#files tbody tr[data-path='notes.txt'] td:nth-child(3)")
    host("open", tool="workspaces", arguments={"action": "list"}, timeZone="Asia/Tokyo")
    host("wait", selector="body[data-ready]")
    [tokyo] = host("text", selector="#files tbody tr[data-path='notes.txt'] td:nth-child(3)")
    assert utc.endswith(" UTC") and not tokyo.endswith(" UTC"), (utc, tokyo)
    hours = (int(tokyo.split(" ")[1][:2]) - int(utc.split(" ")[1][:2])) % 24
    assert hours == 9 and tokyo.split(" ")[1][2:] == utc.split(" ")[1][2:], (utc, tokyo)
    host.clean()


PAGE = "<!doctype html><body style='margin:0;background:#1b9e77'><h1 style='color:#fff'>preview</h1></body>"


def test_service_view_embeds_the_preview_where_the_host_allows_frames_else_links_it(host: Host, tmp_path: Path) -> None:
    write = f'mkdir -p site && printf "%s" "{PAGE}" > site/index.html'
    host("call", tool="execute_command", arguments={"command": write})
    started = host(
        "open",
        tool="execute_command",
        arguments={"command": "cd site && exec python3 -m http.server 8000", "service": {"name": "web", "port": 8000}},
    )
    preview = started["result"]["structuredContent"]["service"]["preview"]
    host("wait", selector="body[data-state='service running']")  # the task view of the call that started it
    host("click", selector="#open")
    assert host("seen")["links"][-1] == preview
    opened = host("open", tool="services", arguments={"action": "list"}, origin=True)
    assert opened["uri"] == "ui://sandbox-server/service"
    assert opened["csp"]["frameDomains"] == [preview.split("/preview/")[0]]
    host("wait", selector="body[data-ready]")
    [source] = host("attr", selector="iframe.preview", name="src")
    assert source.split("?")[0] == preview.split("?")[0]
    host("wait", frame="iframe.preview", selector="h1", text="preview")  # the preview's page loaded in it
    shot = looked_at(host("screenshot", path=str(shot_path(tmp_path, "service.png"))))
    [(x, y, width, height)] = host("boxes", selector="iframe.preview")
    inside = shot[int(y) + 60 : int(y + height) - 4, int(x) + 4 : int(x + width) - 4]
    green = count(inside, (27, 158, 119), 12)
    assert green > inside.shape[0] * inside.shape[1] * 0.8, "the preview's page is not drawn in the view"
    # Another page of the same site (another port), where the browser keeps the framed preview's cookie, may not
    # frame it: only the host's origin is a frame ancestor.
    intruded = host("intrude", url=preview.split("?")[0])
    assert "preview" not in intruded["text"], intruded
    assert any("frame-ancestors" in said for said in intruded["refused"]), intruded

    # The row gives the person the preview (not the address the workspace's calls use); the frame used its link,
    # so opening it from the row asks the server for a fresh one first.
    assert "web:8000" not in host("text", selector="#services tbody tr")[0]
    host("click", selector="button.open-row")
    host("wait", selector="body[data-opened]")
    fresh = host("seen")["links"][-1]
    assert fresh.split("?")[0] == preview.split("?")[0] and fresh != source, (fresh, source)

    host("open", tool="services", arguments={"action": "list"}, frames=False)
    host("wait", selector="body[data-ready]")
    assert host("attr", selector="iframe.preview", name="src") == []
    host("click", selector="#open")
    link = host("seen")["links"][-1]
    assert link.split("?")[0] == preview.split("?")[0]
    host("call", tool="services", arguments={"action": "stop", "name": "web"})
    host.clean()


def test_a_view_takes_the_hosts_dark_theme(host: Host, tmp_path: Path) -> None:
    host("open", tool="workspaces", arguments={"action": "list"}, theme="dark")
    host("wait", selector="body[data-ready]")
    shot = looked_at(host("screenshot", path=str(shot_path(tmp_path, "dark.png"))))
    assert near(shot[5, 5], (27, 30, 36), 6), shot[5, 5]  # the page, dark
    [(x, y, width, height)] = host("boxes", selector="#title")
    title = shot[int(y) : int(y + height), int(x) : int(x + width)]
    assert int((title.sum(axis=2) > 600).sum()) > 100  # light text on it
    host.clean()


def test_a_result_saved_with_call_view_opens_in_its_view_in_a_browser_with_no_host(host: Host, tmp_path: Path) -> None:
    """docs/views.md: `sandbox-server call … --view FILE` on this machine; the file opened as a person opens it."""
    content, frame = weather()
    (tmp_path / "wetter.csv").write_bytes(content)
    page = tmp_path / "wetter.html"
    arguments = json.dumps({"filepath": "wetter.csv", "operations": ["average", "max"], "group_by": ["Stadt"]})
    done = run_cli("call", "analyze_csv", arguments, "--upload", str(tmp_path / "wetter.csv"), "--view", str(page))
    assert done.returncode == 0 and f"view saved: {page.as_uri()}" in done.stdout, done.stdout + done.stderr
    seen = host("saved", url=page.as_uri(), path=str(shot_path(tmp_path, "saved.png")))
    assert seen["problems"] == [] and seen["rows"] == len(CITIES), seen
    means = frame.groupby("Stadt")["Temperatur"].mean()
    for city in CITIES:
        assert city in seen["text"] and str(round(means[city], 4)) in seen["text"], (city, means[city])
    shot = looked_at(seen["path"])
    assert count(shot, ACCENT, 30) > 2000  # its chart's bars, drawn


ICON_STROKE = (34, 102, 221)
"""The tools' icons are drawn in one stroke of this blue (#26d), which reads on light and dark themes alike."""


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_a_tool_picker_shows_each_tools_own_icon_on_either_theme(host: Host, tmp_path: Path, theme: str) -> None:
    """The icons as a client shows them: the official client's tools/list, each icon drawn at 32 and at 16 pixels
    beside its title by Chromium. Each draws its stroke, none is blank, and no two are the same drawing."""
    for size in (32, 16):
        seen = host(
            "picker", path=str(shot_path(tmp_path, f"icons-{theme}-{size}.png")), size=size, dark=theme == "dark"
        )
        shot = looked_at(seen["path"])
        assert sorted(seen["tools"]) == [
            "analyze_csv",
            "execute_command",
            "files",
            "run_python",
            "services",
            "tasks",
            "workspaces",
        ]
        drawings = []
        for icon in seen["icons"]:
            x, y, width, height = (int(round(v)) for v in icon["box"])
            drawn = shot[y : y + height, x : x + width]
            stroke = (np.abs(drawn - np.array(ICON_STROKE)) <= 60).all(axis=2)
            assert icon["drawn"] and 0.08 * size * size < stroke.sum() < 0.6 * size * size, (icon, int(stroke.sum()))
            drawings.append(stroke.tobytes())
        assert len(set(drawings)) == len(drawings)  # seven drawings, not one seven times
    host.clean()


class AppsSupport(ClientExtension):
    """A client that renders MCP Apps, as far as the server can tell."""

    identifier = EXTENSION_ID

    def settings(self) -> dict[str, Any]:
        return {"mimeTypes": [APP_MIME_TYPE]}


@pytest.mark.anyio
@pytest.mark.parametrize("era", ["legacy", "2026-07-28"])
async def test_a_client_without_the_extension_gets_exactly_what_it_got_before(
    server: tuple[str, Path], era: str
) -> None:
    url = server[0]
    code = "import pandas as pd\nx = 1\npd.DataFrame({'a': [1, 2]})"
    async with connect(url, mode=era) as plain, connect(url, mode=era, extensions=[AppsSupport()]) as apps:
        plain_tools = {t.name: t for t in (await plain.list_tools()).tools}
        apps_tools = {t.name: t for t in (await apps.list_tools()).tools}
        assert all("ui" not in (t.meta or {}) for t in plain_tools.values())
        assert all("view" not in (t.output_schema or {}).get("properties", {}) for t in plain_tools.values())
        assert "tasks" not in plain_tools and apps_tools["tasks"].meta == {"ui": {"visibility": ["app"]}}
        linked = {name: (t.meta or {}).get("ui", {}).get("resourceUri") for name, t in apps_tools.items()}
        assert {name for name, uri in linked.items() if uri} == {
            "analyze_csv", "run_python", "execute_command", "workspaces", "services"
        }  # fmt: skip
        for name, tool in plain_tools.items():  # the same tools, said the same way, but for the view
            seen = apps_tools[name].model_dump(exclude={"meta", "output_schema"})
            assert tool.model_dump(exclude={"meta", "output_schema"}) == seen
        plain_uris = [str(r.uri) for r in (await plain.list_resources()).resources]
        assert not any(uri.startswith("ui://") for uri in plain_uris)
        apps_uris = [str(r.uri) for r in (await apps.list_resources()).resources]
        assert {u for u in apps_uris if u.startswith("ui://")} == {f"ui://sandbox-server/{v}" for v in linked_views()}

        before = await plain.call_tool("run_python", {"code": code})
        after = await apps.call_tool("run_python", {"code": code})
        assert before.structured_content is not None and after.structured_content is not None
        assert "view" not in before.structured_content and "view" in after.structured_content
        assert set(after.structured_content) - set(before.structured_content) == {"view"}
        assert [type(b).__name__ for b in before.content] == [type(b).__name__ for b in after.content]
        said = [re.sub(r"ws-[\w-]+", "ws-…", _text(r)).split("\n")[1:] for r in (before, after)]
        assert said[0] == said[1]  # all but the headline's timing, each in a workspace of its own
        volatile = {"duration_ms", "usage", "workspace", "view"}
        steady = {k: v for k, v in after.structured_content.items() if k not in volatile}
        assert {k: v for k, v in before.structured_content.items() if k not in volatile} == steady
        with pytest.raises(MCPError, match="tasks"):  # the app-only tool is not there for it
            await plain.call_tool("tasks", {"action": "list"})
        listed = await apps.call_tool("tasks", {"action": "list"})  # checked against its outputSchema
        assert not listed.is_error and listed.structured_content == {"tasks": []}
        refused = await apps.call_tool("tasks", {"action": "cancel", "task": "no-such-task"})
        assert refused.is_error and _text(refused) == "no task no-such-task of yours"


def linked_views() -> list[str]:
    return ["table", "cell", "task", "files", "service"]


def _text(result: types.CallToolResult) -> str:
    first = result.content[0]
    assert isinstance(first, types.TextContent)
    return first.text
