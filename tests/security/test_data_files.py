"""Battery cases about data files read from a policy's data mount (35, 37), through the real server."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from mcp import Client

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.mcp_harness import connect, stdio_parameters, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.alone, pytest.mark.usefixtures("invariants")]


@pytest.fixture(scope="module")
def data_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("battery-data")
    folder.chmod(0o755)
    with open(folder / "giant-field.csv", "w") as handle:
        handle.write("id,text\n1,")
        for _ in range(200):
            handle.write("x" * 2**20)
        handle.write("\n2,short\n")
    with open(folder / "sparse.csv", "wb") as handle:
        handle.write(b"id,value\n1,2\n")
        handle.truncate(10 * 10**9)  # 10 GB that take no disk
    for item in folder.iterdir():
        item.chmod(0o644)
    return folder


@pytest.fixture(scope="module")
async def server(
    runtime: DockerRuntime, data_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Client]:
    """The default policy with the folder mounted read-only at /data."""
    policy = tmp_path_factory.mktemp("battery-policy") / "data.yaml"
    policy.write_text(
        "name: battery-data\nextends: default\ndefaults:\n  mounts:\n"
        f"    - host: {data_folder}\n      sandbox: /data\n      mode: ro\n"
    )
    async with connect(stdio_parameters("--policy", str(policy))) as session:
        yield session


async def test_35_a_200_mb_field_is_refused_naming_the_line_limit(server: Client) -> None:
    result = await server.call_tool("analyze_csv", {"filepath": "/data/giant-field.csv", "operations": ["count"]})
    assert result.is_error
    assert text_of(result).startswith(
        "/data/giant-field.csv has a line longer than 2,097,152 bytes, the longest analyze_csv reads "
        "under policy 'battery-data' (field limits.csv_line_bytes)"
    ), text_of(result)


async def test_37_a_10_gb_file_is_refused_by_its_size_before_it_is_read(server: Client) -> None:
    started = time.monotonic()
    result = await server.call_tool("analyze_csv", {"filepath": "/data/sparse.csv", "operations": ["count"]})
    assert result.is_error
    assert text_of(result).startswith(
        "/data/sparse.csv is 10,000,000,000 bytes, above the 4,294,967,296 bytes analyze_csv reads under "
        "policy 'battery-data' (field limits.csv_bytes); nothing was read"
    ), text_of(result)
    assert time.monotonic() - started < 10
