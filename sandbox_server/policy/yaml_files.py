"""Reading a YAML file a person or another program wrote (policies, their tests files) as hostile input: a regular
file of bounded size, aliases and nesting bounded, so that an alias bomb, a file a million levels deep or a link to
an endless device is a clear error, never minutes of work, a MemoryError or a traceback."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

__all__ = ["MAX_DEPTH", "MAX_NODES", "MAX_YAML_BYTES", "load_yaml"]

MAX_YAML_BYTES = 8 * 1024 * 1024
MAX_NODES = 200_000
"""Values a document may hold with its aliases expanded: a policy holds hundreds, a tests file thousands; a
billion-laughs bomb of a few lines holds hundreds of millions."""
MAX_DEPTH = 100
"""Policies nest a handful of levels."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, weighing each node as composed: what it would be with every alias written out."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0
        self.weights: dict[int, int] = {}
        """Each composed node's size with its aliases expanded, by its id (the nodes live as long as the loader)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        aliased = self.check_event(yaml.AliasEvent)
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise yaml.YAMLError(f"nested deeper than {MAX_DEPTH} levels")
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        if aliased:
            return node  # weighed where it was anchored, counted again by each parent that names it
        children = node.value if isinstance(node, yaml.CollectionNode) else []
        parts = [part for child in children for part in (child if isinstance(child, tuple) else (child,))]
        weight = 1 + sum(self.weights.get(id(part), 1) for part in parts)
        if weight > MAX_NODES:
            raise yaml.YAMLError(f"more than {MAX_NODES} values once its aliases (*name) are expanded: an alias bomb")
        self.weights[id(node)] = weight
        return node


def load_yaml(path: Path) -> Any:
    """The document at `path`; OSError when it cannot be read as a regular file of at most MAX_YAML_BYTES,
    yaml.YAMLError when it is not YAML within the bounds."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(descriptor, "rb") as handle:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise OSError(f"{path}: not a regular file")
        data = handle.read(MAX_YAML_BYTES + 1)
    if len(data) > MAX_YAML_BYTES:
        raise yaml.YAMLError(f"larger than {MAX_YAML_BYTES} bytes")
    loader = _BoundedLoader(data.decode("utf-8", "replace"))
    try:
        return loader.get_single_data()
    except RecursionError:
        raise yaml.YAMLError("nested too deeply to read") from None
    finally:
        loader.dispose()
