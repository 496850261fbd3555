"""execute_command under the default policy runs in the shell image: the tools people reach for
are there, through the real server."""

from __future__ import annotations

import pytest
from mcp import Client

from tests.mcp_harness import text_of

pytestmark = pytest.mark.anyio

TOOLS = (
    "python3 pip jq git curl sqlite3 xz zip unzip file bc less tree make ps awk sed grep find diff patch tar gzip "
    "bzip2 sort head tail wc node npm"
)


async def test_the_everyday_tools_are_found_and_work(module_session: Client) -> None:
    script = (
        f"for tool in {TOOLS}; do command -v $tool >/dev/null || echo missing $tool; done\n"
        "python3 -c 'print(6 * 7)'\n"
        "node -e 'console.log(6 * 7)'\n"
        "echo '{\"a\": [1, 2]}' | jq -c .a\n"
        "sqlite3 :memory: 'select 40 + 2'\n"
        "echo '2^10' | bc\n"
        "git init -q repo && git -C repo -c user.email=a@b -c user.name=a commit -q --allow-empty -m first "
        "&& git -C repo log --format=%s\n"
    )
    result = await module_session.call_tool("execute_command", {"command": script})
    assert result.structured_content is not None, text_of(result)
    assert result.structured_content["stdout"] == "42\n42\n[1,2]\n42\n1024\nfirst\n", text_of(result)
    assert not result.is_error, text_of(result)


async def test_a_script_with_a_shebang_runs_as_dot_slash(module_session: Client) -> None:
    result = await module_session.call_tool("execute_command", {
        "command": "./count.py",
        "files": [{"path": "count.py", "content": "#!/usr/bin/env python3\nprint(sum(range(10)))\n",
                   "executable": True}],
    })  # fmt: skip
    assert result.structured_content is not None and result.structured_content["stdout"] == "45\n", text_of(result)
