"""Parts of the tools' schemas several tools share: what a call used (`structuredContent.usage`, which the audit
records too), what its sandbox asked of the network, what it changed in its kept workspace, a service started by a
call and the argument that starts one."""

from __future__ import annotations

from typing import Any

__all__ = ["CHANGES_SCHEMA", "NETWORK_SCHEMA", "SERVICE_ARGUMENT", "SERVICE_SCHEMA", "USAGE_SCHEMA"]

_NULLABLE_NUMBER: dict[str, Any] = {"type": ["number", "null"], "minimum": 0}
_NULLABLE_INTEGER: dict[str, Any] = {"type": ["integer", "null"], "minimum": 0}

USAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "What the call used. CPU time and peak memory are read by the host from the sandbox's cgroup "
    "(null where it cannot read them: gVisor, an engine on another host); network bytes are the egress proxy's.",
    "properties": {
        "wall_s": {"type": "number", "minimum": 0, "description": "From the call's arrival to its answer"},
        "cpu_s": {**_NULLABLE_NUMBER, "description": "CPU time of the sandbox's processes during the call"},
        "peak_memory_bytes": {**_NULLABLE_INTEGER, "description": "The sandbox's peak memory"},
        "network_in_bytes": {"type": "integer", "minimum": 0, "description": "Received through the proxy"},
        "network_out_bytes": {"type": "integer", "minimum": 0, "description": "Sent through the proxy"},
        "workspace_bytes": {**_NULLABLE_INTEGER, "description": "What the kept workspace's files take after it"},
        "task": {"type": "boolean", "description": "The call ran as a task (its wall time is the task's)"},
    },
    "required": ["wall_s", "cpu_s", "peak_memory_bytes", "network_in_bytes", "network_out_bytes"],
    "additionalProperties": False,
}


SERVICE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "A service: a program that outlives its call, reachable by the workspace's calls at `url`",
    "properties": {
        "name": {"type": "string"},
        "id": {"type": "string"},
        "state": {"type": "string", "enum": ["starting", "running", "stopping", "stopped"]},
        "port": {"type": "integer"},
        "url": {"type": "string", "description": "How the workspace's next calls reach it"},
        "uptime_s": {"type": "number"},
        "preview": {"type": "string", "description": "Where its caller's browser opens it (HTTP transport)"},
        "stopped_because": {"type": "string"},
        "restarts": {"type": "integer", "description": "How many times it was restarted"},
    },
    "required": ["name", "id", "state", "port", "url"],
}

SERVICE_ARGUMENT: dict[str, Any] = {
    "type": "object",
    "description": "Keep it running as a service (a web server, an API). It runs in a container of "
    "its own that sees the workspace, and the call returns "
    "once it listens on `port`; the workspace's next calls reach it as http://<name>:<port>/ (curl works), and "
    "nothing else can. It stops when the session ends, when idle, or at the policy's maximum lifetime.",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]([a-z0-9-]{0,30}[a-z0-9])?$", "description": "Its host name"},
        "port": {"type": "integer", "minimum": 1, "maximum": 65535, "description": "The TCP port it listens on"},
        "ready_path": {
            "type": "string",
            "pattern": "^/[!-~]*$",
            "maxLength": 2048,
            "description": "Wait until a GET of this path answers (below 500), not only until the port listens",
        },
    },
    "required": ["name", "port"],
    "additionalProperties": False,
}


NETWORK_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "With a policy that allows a network: every request the sandbox made through its proxy.",
    "properties": {
        "requests": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "method": {"type": "string"}, "host": {"type": "string"}, "port": {"type": "integer"},
                    "allowed": {"type": "boolean"}, "status": {"type": "integer"},
                    "bytes_in": {"type": "integer"}, "bytes_out": {"type": "integer"},
                    "proxy_error": {
                        "type": "string",
                        "description": "The proxy answered itself, with this error (ERR_CONNECT_FAIL: the host is "
                        "allowed, but nothing took the connection; ERR_DNS_FAIL: its name has no address)",
                    },
                },
                "required": ["method", "host", "port", "allowed", "status", "bytes_in", "bytes_out"],
            },
        },
        "denied": {"type": "array", "items": {"type": "string"}, "description": "host:port the policy refused."},
        "requests_not_kept": {
            "type": "integer",
            "description": "Requests made before those listed, counted but not listed (an answer lists the latest 200).",
        },
        "denied_not_listed": {"type": "integer", "description": "Refused host:port past the 200 `denied` lists."},
        "asked": {
            "type": "array",
            "description": "Hosts not on the allow list decided during the call (network.ask): the person's answer "
            "(accept, decline, cancel, no answer), an earlier one, or why nobody was asked.",
            "items": {
                "type": "object",
                "properties": {"host": {"type": "string"}, "port": {"type": "integer"}, "answer": {"type": "string"},
                               "why": {"type": "string"}},
                "required": ["host", "port", "answer"],
            },
        },
    },
    "required": ["requests", "denied"],
}  # fmt: skip


CHANGES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "What the call changed in its kept workspace (beside it, calls running side by side in it): "
    "files created, modified, deleted and renamed, at most 50 paths, `more` counting the rest",
    "properties": {
        **{kind: {"type": "array", "items": {"type": "string"}} for kind in ("created", "modified", "deleted")},
        "renamed": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
                "required": ["from", "to"],
            },
        },
        "more": {"type": "integer", "minimum": 0},
    },
    "required": ["created", "modified", "deleted", "renamed", "more"],
}
