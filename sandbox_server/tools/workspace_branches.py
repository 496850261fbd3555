"""The `workspaces` tool's branches: `branch` forks the call's workspace once per call asked for and runs each call
in its fork, side by side, each admitted and audited as any call is; `compare` says what each branch changed from
the workspace it came from (files and variables), for the caller to keep one and delete the rest."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
import anyio.to_thread

from sandbox_server.errors import Refusal
from sandbox_server.tools.base import ToolContext, ToolOutcome
from sandbox_server.tools.workspace_rows import call_summary, compare_rows
from sandbox_server.workspaces.compare import compared_line
from sandbox_server.workspaces.kept import KeptWorkspace
from sandbox_server.workspaces.records import WorkspaceRecord

__all__ = ["branch", "compare"]

SAID_LINES, SAID_CHARS = 3, 200
"""The last lines of a branch's output its text shows, each cut to this many characters."""


async def compare(
    args: Mapping[str, Any], kept: KeptWorkspace, extra: dict[str, Any], sections: list[tuple[str, str]]
) -> str:
    store, base = kept.store, kept.record
    wanted = args.get("branches")
    if not isinstance(wanted, list) or not wanted:
        raise Refusal("refused: `compare` needs the `branches` to compare with the call's workspace", "branches")
    branches = [store.resolve(str(item), base.session, base.tenant) for item in wanted]
    rows = await compare_rows(store, base, branches)
    extra["branches"] = rows
    sections.append(("branches", "\n".join(compared_line(row) for row in rows)))
    return (
        f"{len(rows)} branch(es) compared with workspace {base.name or base.id}: keep the one you want "
        '({"action": "keep", "workspace": "<its id>", "name": …}) and delete the others'
    )


async def branch(
    args: Mapping[str, Any],
    kept: KeptWorkspace,
    ctx: ToolContext,
    extra: dict[str, Any],
    sections: list[tuple[str, str]],
) -> str:
    asked = args.get("calls")
    if not isinstance(asked, list) or not asked:
        raise Refusal("refused: `branch` needs the `calls` to run, one per branch", "calls")
    if ctx.branch is None:
        raise Refusal("refused: this server runs no branch calls", "calls")
    run = ctx.branch
    store, base = kept.store, kept.record
    forks: list[WorkspaceRecord] = []
    try:
        for _ in asked:  # each bounded as any fork is: all of them or none
            forks.append(await anyio.to_thread.run_sync(store.fork, base, None, ctx.policy_name))
    except Refusal:
        for made in forks:
            store.forget(made)
        raise
    outcomes: list[ToolOutcome | None] = [None] * len(forks)

    async def one(index: int) -> None:
        call = asked[index]
        outcomes[index] = await run(str(call["tool"]), call.get("arguments") or {}, forks[index].id)

    async with anyio.create_task_group() as group:  # side by side, each admitted as any call is
        for index in range(len(forks)):
            group.start_soon(one, index)
    rows = await compare_rows(store, base, [store.resolve(f.id, f.session, f.tenant) for f in forks])
    for each, call, outcome in zip(rows, asked, outcomes, strict=True):
        each["call"] = call_summary(str(call["tool"]), outcome)
    extra["branches"] = rows
    said = [f"{each['call']['tool']}: {each['call']['headline']}{_said(each['call'])}\n  {compared_line(each)}"
            for each in rows]  # fmt: skip
    sections.append(("branches", "\n".join(said)))
    failed = sum(1 for each in rows if each["call"]["is_error"])
    return (
        f"{len(rows)} branch(es) of workspace {base.name or base.id} ran"
        + (f" ({failed} ended in an error)" if failed else "")
        + ": each is a fork (its id in `workspace`); keep the one you want "
        '({"action": "keep", "workspace": "<its id>", "name": …}) and delete the others'
    )


def _said(call: Mapping[str, Any]) -> str:
    """The last lines a branch's call printed (its scores, its answer), for the text a model reads."""
    lines = [line.strip()[:SAID_CHARS] for line in str(call["stdout"]).splitlines() if line.strip()]
    return "\n  output: " + " | ".join(lines[-SAID_LINES:]) if lines else ""
