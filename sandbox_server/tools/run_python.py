"""run_python: run a notebook-style Python cell with pandas, numpy and matplotlib."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from sandbox_server.policy import ToolPolicy
from sandbox_server.sandbox import wire
from sandbox_server.sandbox.engine.wheels import libraries
from sandbox_server.sandbox.spec import OutputFile
from sandbox_server.tools.arguments import sandbox_spec
from sandbox_server.tools.base import (
    FILES_SCHEMA,
    SANDBOX_ANNOTATIONS,
    TIMEOUT_SCHEMA,
    WORKSPACE_ARGUMENT,
    Sandboxed,
    ToolContext,
    ToolOutcome,
    result_schema,
)
from sandbox_server.tools.execute_command import EXECUTION_PROPERTIES, EXECUTION_REQUIRED
from sandbox_server.tools.outcome import outcome_from_execution
from sandbox_server.tools.schemas import SERVICE_ARGUMENT
from sandbox_server.tools.services import start_service

__all__ = ["RunPython"]


KEPT_NOTE = "variables kept for the next cell"
"""How the answer's note on kept variables begins (a one-shot client, whose server ends with the call, says
otherwise)."""


Kept = tuple[list[str], list[str], dict[str, str]]
"""The sandbox's report on a cell's variables: those kept, those not kept, and what each kept one is."""


def _kept(report: OutputFile) -> Kept | None:
    """The report read (None when it is unreadable)."""
    try:
        names = json.loads(report.content)
        kept, not_kept = [str(n) for n in names["kept"]], [str(n) for n in names["not_kept"]]
    except (ValueError, KeyError, TypeError):
        return None
    about = names.get("about")
    return kept, not_kept, {str(n): str(said) for n, said in about.items()} if isinstance(about, dict) else {}


def _view(report: OutputFile | None, kept: Kept | None, value: OutputFile | None) -> dict[str, Any]:
    """What the cell's view shows beside its outputs: its value as a table (a DataFrame or Series), and the variables
    kept for the next cell with what each is (its type and shape or length)."""
    view: dict[str, Any] = {}
    unreadable = report is not None and kept is None
    if value is not None:
        try:
            view["value"] = json.loads(value.content)
        except ValueError:
            unreadable = True
    if kept is not None:
        view["variables"] = [{"name": n, "about": kept[2].get(n, "")} for n in kept[0]]
        view["not_kept"] = kept[1]
    if unreadable:
        view["problem"] = "the sandbox's report on the cell's value or variables is unreadable"
    return view


def _kept_variables(kept: Kept | None) -> str:
    """The answer's note on what the next cell will find: `kept: df, totals; not kept: fig (Figure)`."""
    if kept is None:
        return "variables: the sandbox's report of what was kept is unreadable"
    names, not_kept = kept[0], kept[1]
    return f"{KEPT_NOTE}: {', '.join(names) or 'none'}" + (f"; not kept: {', '.join(not_kept)}" if not_kept else "")


def _installed() -> str:
    """The libraries the python-data image pins, with their major and minor versions (from its wheels.lock)."""
    named = ", ".join(f"{library} {'.'.join(version.split('.')[:2])}" for library, version in libraries("python-data"))
    return f"Installed: {named}." if named else "pandas, numpy and matplotlib are installed."


class RunPython(Sandboxed):
    """Run Python code in a fresh container from the python-data image."""

    name = "run_python"
    title = "Run Python in a sandbox"
    description = (
        "A notebook cell of Python 3.11 in a fresh sandbox (no network). "
        f"{_installed()} A final expression's value is printed; figures and /workspace/out's files come back. "
        "Where workspaces are kept, the next cell finds /workspace and the picklable variables.\n"
        'Example: {"code": "import numpy as np\\nnp.arange(6).reshape(2, 3)"}'
    )
    input_schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "minLength": 1, "description": "Python 3 source."},
            "timeout_s": TIMEOUT_SCHEMA,
            "files": FILES_SCHEMA,
            "workspace": WORKSPACE_ARGUMENT,
            "service": SERVICE_ARGUMENT,
        },
        "title": "run_python: arguments",
        "required": ["code"],
        "additionalProperties": False,
    }
    output_schema = result_schema("run_python: result", EXECUTION_PROPERTIES, EXECUTION_REQUIRED)
    annotations = SANDBOX_ANNOTATIONS

    def refuse(self, args: Mapping[str, Any], policy: ToolPolicy, policy_name: str) -> None:
        """Nothing of its own: the code is the sandbox's to run."""

    async def run(self, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutcome:
        """Run the cell; an exception's last traceback line becomes the headline."""
        if "service" in args:  # an app that serves (Dash, Streamlit, a small API): the code runs as the program
            spec = sandbox_spec(args, ctx, ("python3", "-c", args["code"]), b"")
            return await start_service({**args, "command": args["code"]}, ctx, spec, self.name, args)
        limits = ctx.policy.limits
        per_image = limits.returned_image_bytes // max(1, limits.returned_images)
        spec = sandbox_spec(
            args,
            ctx,
            ("python3", wire.RUN_CELL),
            args["code"].encode("utf-8", "surrogatepass"),
            extra_env=(
                (wire.IMAGE_BYTES_ENV, str(per_image)),
                (wire.KEEP_VARIABLES_ENV, "1" if ctx.kept_workspace else ""),
            ),
        )
        result = await ctx.runtime.run(spec, ctx.hooks)
        report = next((f for f in result.files if f.path == wire.CELL_STATE_REPORT), None)
        value = next((f for f in result.files if f.path == wire.CELL_VALUE), None)
        result = replace(result, files=tuple(f for f in result.files if f is not report and f is not value))
        kept = _kept(report) if report is not None else None
        outcome = replace(outcome_from_execution(result, spec), view=_view(report, kept, value))
        if report is not None:
            outcome = replace(outcome, notes=(*outcome.notes, _kept_variables(kept)))
        elif not ctx.kept_workspace:
            said = (
                f"variables are not kept: policy '{ctx.policy_name}' keeps no workspace (field workspace.persist), "
                "so the next cell starts empty"
            )
            outcome = replace(outcome, notes=(*outcome.notes, said))
        stderr = result.stderr.decode("utf-8", "replace").rstrip()
        if result.exit_code == 1 and ("Traceback" in stderr or "Error" in stderr.rsplit("\n", 1)[-1]):
            last_line = stderr.rsplit("\n", 1)[-1].strip()
            outcome = replace(outcome, headline=f"{last_line} (exit code 1) · {result.duration_ms} ms")
        return outcome
