"""Every refusal the server can raise names the policy field or argument that decided it (only the engine's own
faults have none to name), so that a security team can tell from any answer which setting to change."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "sandbox_server"
FIELDLESS = {"engine_unavailable", "engine_error"}


def _refusals() -> list[tuple[str, ast.Call]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Refusal":
                found.append((f"{path.relative_to(PACKAGE)}:{node.lineno}", node))
    return found


def test_every_refusal_names_its_field() -> None:
    refusals = _refusals()
    assert len(refusals) > 30  # the check sees them all
    unnamed = []
    for where, call in refusals:
        keywords = {keyword.arg: keyword.value for keyword in call.keywords}
        kind = keywords.get("kind")
        if isinstance(kind, ast.Constant) and kind.value in FIELDLESS:
            continue
        field = call.args[1] if len(call.args) > 1 else keywords.get("field")
        if field is None or (isinstance(field, ast.Constant) and not field.value):
            unnamed.append(where)
    assert unnamed == []
