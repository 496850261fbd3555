"""A policy file read into one document: its YAML checked against the policy schema (every error with its field
and a way out), its `extends` chain merged in, older spellings read as today's; and one tool's settings in it."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from jsonschema.protocols import Validator

from sandbox_server.policy.ecma import SchemaValidator
from sandbox_server.policy.hints import in_words, unexpected_key_hint
from sandbox_server.policy.references import policy_path
from sandbox_server.policy.yaml_files import load_yaml
from sandbox_server.shipped import policy_schema_path

__all__ = ["effective_tool_settings", "resolved_document", "schema"]


@cache
def schema() -> dict[str, Any]:
    """The JSON Schema of policy files (draft 2020-12)."""
    return dict(json.loads(policy_schema_path().read_text()))


@cache
def _validator() -> Validator:
    return SchemaValidator(schema())


def _field(path: Iterable[Any]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _read(path: Path) -> tuple[dict[str, Any] | None, list[str]]:
    try:
        document = load_yaml(path)
    except OSError as exc:
        return None, [f"{path}: cannot read: {exc.strerror or exc}"]
    except yaml.YAMLError as exc:
        return None, [f"{path}: not valid YAML: {exc}"]
    if document is None:
        document = {}
    if not isinstance(document, dict):
        return None, [f"{path}: (top level): must be a mapping of policy fields, not {type(document).__name__}"]
    errors = []
    for error in sorted(_validator().iter_errors(document), key=lambda e: list(map(str, e.absolute_path))):
        hint = unexpected_key_hint(error, schema())
        errors.append(f"{path}: {_field(error.absolute_path)}: {in_words(error)}" + (f": {hint}" if hint else ""))
    return document, errors


def _merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key; everything else (lists included) is replaced."""
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def resolved_document(path: Path, trail: tuple[Path, ...] = ()) -> tuple[dict[str, Any], list[str]]:
    """A policy file with its `extends` chain merged in, and every error found on the way."""
    path = path.resolve()
    if path in trail:
        chain = " -> ".join(str(p) for p in (*trail, path))
        return {}, [f"{trail[-1]}: extends: the chain comes back to itself ({chain})"]
    document, errors = _read(path)
    if document is None:
        return {}, errors
    parent_reference = document.get("extends")
    resolved: dict[str, Any] = {}
    if isinstance(parent_reference, str):
        parent_path = policy_path(parent_reference, path.parent)
        if not parent_path.exists():
            errors.append(f"{path}: extends: no policy {parent_reference!r} (looked for {parent_path})")
        else:
            parent, parent_errors = resolved_document(parent_path, (*trail, path))
            errors.extend(parent_errors)
            resolved = {key: value for key, value in parent.items() if key not in ("name", "description")}
            if isinstance(document.get("defaults"), Mapping) and "pool" in document["defaults"]:
                resolved = _without_tool_pools(resolved)
            resolved = _without_pools_it_sets(resolved, document)
    merged = _merge(resolved, _pool_size_as_min({key: value for key, value in document.items() if key != "extends"}))
    merged.setdefault("name", path.stem)
    return merged, errors


def _without_tool_pools(document: dict[str, Any]) -> dict[str, Any]:
    """The policy a file extends, less its tools' own pools: a file's `defaults.pool` sets the pool of every tool
    it does not name itself (`default` gives execute_command a deeper pool than its other tools)."""
    tools = document.get("tools")
    if not isinstance(tools, Mapping):
        return document
    kept = {name: {k: v for k, v in section.items() if k != "pool"} if isinstance(section, Mapping) else section
            for name, section in tools.items()}  # fmt: skip
    return {**document, "tools": kept}


def _without_pools_it_sets(parent: dict[str, Any], document: Mapping[str, Any]) -> dict[str, Any]:
    """The policy a file extends, less each pool the file sets itself: a pool is taken whole from the nearest file
    that writes it (`pool: {min: 2, max: 8}` is a pool of at most 8, whatever `ahead` or `runc` the file it extends
    gave), as a reader of the file takes it."""
    parent = copy.deepcopy(parent)
    if isinstance(document.get("defaults"), Mapping) and "pool" in document["defaults"]:
        if isinstance(parent.get("defaults"), dict):
            parent["defaults"].pop("pool", None)
    tools, theirs = document.get("tools"), parent.get("tools")
    if isinstance(tools, Mapping) and isinstance(theirs, dict):
        for name, section in tools.items():
            if isinstance(section, Mapping) and "pool" in section and isinstance(theirs.get(name), dict):
                theirs[name].pop("pool", None)
    return parent


def _pool_size_as_min(document: dict[str, Any]) -> dict[str, Any]:
    """`pool.size` (the older name) read as `pool.min` before merging, so a file's `size` overrides the
    `min` of the policy it extends."""
    sections = [document.get("defaults")]
    if isinstance(document.get("tools"), Mapping):
        sections.extend(document["tools"].values())
    for section in sections:
        pool = section.get("pool") if isinstance(section, Mapping) else None
        if isinstance(pool, dict) and "size" in pool and "min" not in pool:
            pool["min"] = pool.pop("size")
    return document


def effective_tool_settings(document: Mapping[str, Any], tool: str) -> dict[str, Any]:
    """One tool's settings: its section merged over `defaults`."""
    return _merge(document.get("defaults", {}), document.get("tools", {}).get(tool, {}))
