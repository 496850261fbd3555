"""A server installed without its extras works: no module on the path of a server without `--state` or
`--otlp-endpoint` imports what only those extras install (the wheel's test then proves a real call)."""

from __future__ import annotations

import subprocess
import sys

EXTRAS = ("psycopg", "psycopg_pool", "opentelemetry.sdk", "opentelemetry.exporter")
"""What `sandbox-server[postgresql]` and `sandbox-server[telemetry]` install (the OpenTelemetry API comes with the
MCP SDK itself)."""
NEEDING_EXTRAS = {
    "sandbox_server.access.shared",
    "sandbox_server.protocol.handover",
    "sandbox_server.state.database",
    "sandbox_server.state.files",
    "sandbox_server.state.homes",
    "sandbox_server.tasks.shared",
    "sandbox_server.workspaces.homed",
    "sandbox_server.workspaces.shared",
}
"""The modules a server given `--state` loads, and it alone."""

PROGRAM = f"""
import importlib, pkgutil, sys

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if any(name == extra or name.startswith(extra + ".") for extra in {EXTRAS!r}):
            raise ImportError("not installed: " + name)

sys.meta_path.insert(0, NotInstalled())
import sandbox_server
for module in pkgutil.walk_packages(sandbox_server.__path__, "sandbox_server."):
    if module.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(module.name)
    except ImportError as exc:
        print(module.name, exc)
"""


def test_only_the_modules_of_shared_state_need_an_extra() -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    failed = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert set(failed) == NEEDING_EXTRAS, failed
