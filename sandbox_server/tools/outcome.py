"""What a sandboxed run comes back as: its headline (the first line a model reads, naming the policy field of
any limit it hit), its output, its files, the structured result and the audit record's facts."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from sandbox_server.sandbox.spec import ExecutionResult, ResourceLimits, SandboxSpec
from sandbox_server.tools.base import ToolOutcome
from sandbox_server.workspaces.naming import shown_time

__all__ = ["outcome_from_execution"]


@dataclass(frozen=True, slots=True)
class _Headline:
    text: str
    is_error: bool = True


NO_NETWORK = re.compile(
    r"Temporary failure in name resolution|Could not resolve host|Name or service not known|Network is unreachable"
    r"|No address associated with hostname|getaddrinfo|ENOTFOUND|EAI_AGAIN|Failed to establish a new connection"
    r"|No matching distribution found"
)
"""What programs print when they reach for a network a sandbox does not have."""
NO_NETWORK_NOTE = (
    "the sandbox has no network: this policy's tool has none (policy field network: none); a policy whose "
    "network lists the hosts it may reach (an allow list) opens them, and nothing else"
)
SIGNALS = {9: "SIGKILL", 15: "SIGTERM", 24: "SIGXCPU", 25: "SIGXFSZ", 11: "SIGSEGV", 6: "SIGABRT"}


def _headline(result: ExecutionResult, limits: ResourceLimits) -> _Headline:
    if result.oom_killed:
        late = f", past its timeout of {limits.timeout_s:g} s" if result.timed_out else ""
        return _Headline(f"killed: out of memory ({limits.memory_mb} MiB{late}); policy field limits.memory_mb")
    if result.timed_out:
        pressed = (
            f", its memory having reached its limit of {limits.memory_mb} MiB (policy field limits.memory_mb: at the "
            "limit the kernel reclaims memory, which slows a program)"
            if result.at_memory_limit
            else ""
        )
        return _Headline(
            f"timed out after {limits.timeout_s:g} s{pressed} (partial output below); the call's timeout_s, at "
            "most the policy field limits.max_timeout_s"
        )
    if result.flooded:
        return _Headline(
            "killed: output flood (far more output than the cap; partial output below); "
            "policy field limits.output_bytes"
        )
    if result.killed:
        return _Headline("killed: the sandbox was killed from outside before the program finished")
    if result.pids_limited:
        return _Headline(
            f"process limit reached: forks failed at {limits.pids} processes (policy field limits.pids); "
            f"exit code {result.exit_code}"
        )
    if result.exit_code == 0:
        return _Headline("exit code 0", is_error=False)
    if result.exit_code is not None and result.exit_code > 128:
        number = result.exit_code - 128
        name = SIGNALS.get(number, "")
        if number == 25:
            name += f": a file grew past {limits.file_size_mb} MiB (policy field limits.file_size_mb)"
        return _Headline(f"exit code {result.exit_code} (killed by signal {number}{' ' + name if name else ''})")
    return _Headline(f"exit code {result.exit_code}")


def outcome_from_execution(result: ExecutionResult, spec: SandboxSpec) -> ToolOutcome:
    """The common rendering of a sandboxed run: headline, stdout, stderr, files, structured data."""
    headline = _headline(result, spec.limits)
    stdout = result.stdout.decode("utf-8", "replace")
    stderr = result.stderr.decode("utf-8", "replace")
    structured = {
        "exit_code": result.exit_code,
        "stdout": stdout,
        "stderr": stderr,
        "timed_out": result.timed_out,
        "oom_killed": result.oom_killed,
        "duration_ms": result.duration_ms,
        "truncated": result.truncated,
        "files": [{"path": f.path, "size": f.size, "modified": shown_time(f.mtime)} for f in result.files],
    }
    audit = {
        "container_id": result.container_id[:12],
        "address": result.address,
        "image": spec.image,
        "runtime": spec.runtime,
        "limits": asdict(spec.limits),
        "exit_code": result.exit_code,
        "run_ms": result.duration_ms,
        "timed_out": result.timed_out,
        "oom_killed": result.oom_killed,
        "pids_limited": result.pids_limited,
        "killed": result.killed,
        "flooded": result.flooded,
        "stdout_bytes": len(result.stdout) + result.stdout_truncated_bytes,
        "stderr_bytes": len(result.stderr) + result.stderr_truncated_bytes,
        "files_bytes": sum(f.size for f in result.files),
        "cpu_s": result.cpu_s,
        "peak_memory_bytes": result.peak_memory_bytes,
    }
    text, is_error = headline.text, headline.is_error
    if result.truncated and not result.flooded:  # said first, not only where the marker sits mid-output
        cut = [f"{n} bytes of {name}" for name, n in (("stdout", result.stdout_truncated_bytes),
                                                      ("stderr", result.stderr_truncated_bytes)) if n]  # fmt: skip
        text += f"; output cut to the cap: {' and '.join(cut)} dropped (policy field limits.output_bytes)"
    if result.workspace_problem:
        text, is_error = f"{text}; {result.workspace_problem}", True
    return ToolOutcome(
        headline=f"{text} · {result.duration_ms} ms",
        is_error=is_error,
        sections=(("stdout", stdout), ("stderr", stderr)),
        structured=structured,
        files=result.files,
        notes=result.skipped_files + _network_note(spec, stdout, stderr) + _tmp_note(spec, stderr),
        audit=audit,
        outputs=result.whole_output,
    )


NOT_FROM_TMP = re.compile(r"^\S+: (?:line )?\d+: /tmp/\S*: Permission denied", re.MULTILINE)
"""What a shell (bash or dash, naming the line) says when it is asked to run a program under /tmp, which is mounted
noexec."""


def _tmp_note(spec: SandboxSpec, stderr: str) -> tuple[str, ...]:
    """A note saying why a program under /tmp would not run, and where one may."""
    if NOT_FROM_TMP.search(stderr[-20_000:]) is None:
        return ()
    where = (
        "build and run programs under /workspace instead"
        if spec.limits.workspace_exec
        else "this policy runs no program from /workspace either (policy field workspace.exec)"
    )
    return (f"/tmp is mounted noexec: nothing under it runs as a program; {where}",)


def _network_note(spec: SandboxSpec, stdout: str, stderr: str) -> tuple[str, ...]:
    """A note naming the field that opens a network, when a program without one reached for it."""
    reached = spec.network == "none" and NO_NETWORK.search(stderr[-20_000:] + stdout[-20_000:]) is not None
    return (NO_NETWORK_NOTE,) if reached else ()
