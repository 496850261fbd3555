"""run_python: run a notebook-style Python cell with pandas, numpy and matplotlib."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from sandbox_server.sandbox.spec import SandboxSpec
from sandbox_server.tools.base import (
    FILES_SCHEMA,
    ToolContext,
    ToolOutcome,
    decode_files,
    outcome_from_execution,
    refuse_timeout,
)
from sandbox_server.tools.execute_command import OUTPUT_SCHEMA

__all__ = ["RunPython"]

RUNNER = "/usr/local/lib/sandbox/run_cell.py"


class RunPython:
    """Run Python code in a fresh container from the python-data image."""

    name = "run_python"
    title = "Run Python (pandas, numpy, matplotlib) in a sandbox"
    description = (
        "Run Python 3 code like a notebook cell in a fresh, isolated container (no network) that is "
        "destroyed afterwards. pandas, numpy and matplotlib are installed. The value of a final "
        "expression is printed; every matplotlib figure the code creates comes back as a PNG image; "
        "files written to /workspace/out come back as resources. Input files land in /workspace.\n"
        'Example: {"code": "import pandas as pd\\ndf = pd.read_csv(\'data.csv\')\\ndf.describe()", '
        '"files": [{"path": "data.csv", "content": "x,y\\n1,2\\n3,4\\n"}]}\n'
        'Example: {"code": "import matplotlib.pyplot as plt\\nplt.plot([1, 4, 9])\\nplt.title(\'squares\')"}'
    )
    input_schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "minLength": 1, "description": "Python 3 source, run as one cell."},
            "timeout_s": {
                "type": "number",
                "exclusiveMinimum": 0,
                "description": "Wall-clock limit in seconds; the policy caps it.",
            },
            "files": FILES_SCHEMA,
        },
        "required": ["code"],
        "additionalProperties": False,
    }
    output_schema = OUTPUT_SCHEMA
    annotations: dict[str, Any] = {
        "readOnlyHint": False,
        "destructiveHint": False,
        "idempotentHint": False,
        "openWorldHint": False,
    }

    async def run(self, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutcome:
        """Run the cell; an exception's last traceback line becomes the headline."""
        policy = ctx.policy
        refusal = refuse_timeout(args.get("timeout_s"), policy, ctx.policy_name)
        if refusal:
            return ToolOutcome.refusal(refusal)
        files = decode_files(args.get("files", []), policy)
        if isinstance(files, str):
            return ToolOutcome.refusal(f"refused: {files}")
        limits = policy.limits
        if "timeout_s" in args:
            limits = replace(limits, timeout_s=float(args["timeout_s"]))
        per_image = limits.returned_image_bytes // max(1, limits.returned_images)
        spec = SandboxSpec(
            image=policy.image,
            argv=("python3", RUNNER),
            limits=limits,
            runtime=policy.runtime,
            user=policy.user,
            network=policy.network,
            env=(*policy.env, ("SANDBOX_IMAGE_BYTES", str(per_image))),
            stdin=args["code"].encode("utf-8", "surrogatepass"),
            files=files,
            mounts=policy.mounts,
            seccomp_profile=policy.seccomp_profile,
        )
        result = await ctx.runtime.run(spec, ctx.on_progress)
        outcome = outcome_from_execution(result, spec)
        stderr = result.stderr.decode("utf-8", "replace").rstrip()
        if result.exit_code == 1 and ("Traceback" in stderr or "Error" in stderr.rsplit("\n", 1)[-1]):
            last_line = stderr.rsplit("\n", 1)[-1].strip()
            outcome = replace(outcome, headline=f"{last_line} (exit code 1) · {result.duration_ms} ms")
        return outcome
