"""Which calls a person must approve first (a policy's `approval` section), and what they are shown.

Pure logic: the server asks through the client (an elicitation) and keeps the decision.
Approval keeps a human in the loop; it is not a boundary against a client that answers
for itself, so everything a policy enforces stays enforced for approved calls too.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
import secrets
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sandbox_server.policy import ApprovalSettings, ToolPolicy

__all__ = [
    "APPROVAL_FORM", "Approval", "approval_needed", "approval_notice", "lapses_at", "new_question", "shell_commands",
]  # fmt: skip

APPROVAL_FORM: dict[str, Any] = {"type": "object", "properties": {}}
"""The form shown with the question: nothing to fill in, the answer is accept, decline or cancel."""
SHOWN_TEXT_CHARS = 4000
"""How much of a program or cell the question shows before saying how much more there is."""


@dataclass(frozen=True, slots=True)
class Approval:
    """Why a call needs a person's yes, and what they are shown."""

    policy: str
    field: str
    """The policy field that asks (approval.commands, approval.tools, approval.writable_mounts)."""
    reason: str
    message: str
    """The question, showing exactly what will run."""


def _command_line(arguments: Mapping[str, Any]) -> tuple[list[str], str]:
    """(the words of an execute_command call when it gives `args`, else none; the whole command line)."""
    command = str(arguments.get("command", ""))
    if "args" in arguments:
        words = [command, *map(str, arguments["args"])]
        return words, shlex.join(words)
    return [], command


SEPARATORS = frozenset({";", "&", "&&", "|", "||", "|&", "(", ")", ";;", ";&", "{", "}", "!"})
"""Tokens between the commands of a shell line."""
KEYWORDS = frozenset({"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "case", "esac", "in"})
WRAPPERS = frozenset(
    {
        "exec", "command", "builtin", "nohup", "nice", "ionice", "env", "sudo", "doas", "timeout", "xargs",
        "stdbuf", "setsid", "chrt", "taskset", "time", "busybox", "unbuffer", "flock", "chroot", "strace",
    }
)  # fmt: skip
"""Programs that run the program named after them (and their options)."""
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "ash", "mksh", "busybox"})
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
SUBSTITUTION = re.compile(r"\$\(([^()]*)\)|`([^`]*)`")
MAX_NESTING = 4
MAX_WRAPPER_WORDS = 4


def shell_commands(line: str, nesting: int = 0) -> list[list[str]]:
    """The words of every command a shell line would run, as far as reading it can tell.

    Seen: commands after `;`, `&&`, `||`, `|`, `&`, newlines and in subshells; inside `$(…)`,
    backticks, `sh -c '…'` (any shell), `eval …` and `find -exec …`; behind variable
    assignments and wrappers (`env`, `sudo`, `xargs`, `nice`, `timeout`, `command`, `exec`, …).
    Not seen: what a program does by itself (`find -delete`, a script, `python -c`), names made
    at run time (`$CMD`, `$(echo rm)`), aliases and functions, and text decoded and piped to a shell.
    """
    if nesting > MAX_NESTING:
        return []
    lexer = shlex.shlex(line.replace("\n", ";"), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # not a line a shell would read whole (an open quote): by words
        tokens = line.split()
    found: list[list[str]] = []
    for inner in SUBSTITUTION.finditer(line):
        found += shell_commands(inner.group(1) or inner.group(2) or "", nesting + 1)
    segment: list[str] = []
    for token in [*tokens, ";"]:
        if token not in SEPARATORS:
            segment.append(token)
            continue
        found += _command_words(segment, nesting)
        segment = []
    return found


def _command_words(words: list[str], nesting: int) -> list[list[str]]:
    """One command's words from its program on, and the commands it runs in turn."""
    words = [word.lstrip("`") for word in words if word.strip("`")]
    while words and (ASSIGNMENT.match(words[0]) or words[0] in KEYWORDS):
        words = words[1:]
    if not words:
        return []
    found = [words]
    program, rest = words[0].rsplit("/", 1)[-1], words[1:]
    if program in WRAPPERS:
        # Which of its words are its options' values is its own business: each later word that is not an
        # option may be the program it runs (asking about one more is the safe side).
        starts = [i for i, word in enumerate(rest) if not word.startswith("-") and not ASSIGNMENT.match(word)]
        for start in starts[:MAX_WRAPPER_WORDS]:
            found += _command_words(rest[start:], nesting + 1)
    if program in SHELLS and "-c" in rest[:-1]:
        found += shell_commands(rest[rest.index("-c") + 1], nesting + 1)
    elif program == "eval":
        found += shell_commands(" ".join(rest), nesting + 1)
    elif program == "find":
        for index, word in enumerate(rest):
            if word in ("-exec", "-execdir", "-ok", "-okdir"):
                command = []
                for later in rest[index + 1 :]:
                    if later in (";", "+"):
                        break
                    command.append(later)
                found += _command_words(command, nesting)
    return found


def _matching(patterns: tuple[str, ...], words: list[str], line: str) -> str | None:
    """The first pattern matching a program the line runs (as written, or its file name), that program's
    command, or the whole line."""
    commands = _command_words(words, 0) if words else shell_commands(line)
    names = {line}
    for command in commands:
        program = command[0].rsplit("/", 1)[-1]
        names |= {command[0], program, shlex.join(command), " ".join(command), " ".join([program, *command[1:]])}
    return next((p for p in patterns if any(fnmatch.fnmatchcase(name, p) for name in names)), None)


def _truncated(text: str) -> str:
    """Text for a person to read in full up to SHOWN_TEXT_CHARS, then cut, saying how much was left out."""
    if len(text) <= SHOWN_TEXT_CHARS:
        return text
    return f"{text[:SHOWN_TEXT_CHARS]}\n… ({len(text) - SHOWN_TEXT_CHARS} more characters not shown)"


def _what_runs(tool: str, arguments: Mapping[str, Any]) -> str:
    """What the call will do, as a person reads it."""
    if tool == "execute_command":
        _, line = _command_line(arguments)
        shown = f"$ {_truncated(line)}"
    elif tool == "run_python":
        shown = _truncated(str(arguments.get("code", "")))
    else:
        rest = {k: v for k, v in arguments.items() if k not in ("files", "workspace")}
        shown = _truncated(json.dumps(rest, indent=2, ensure_ascii=False))
    files = arguments.get("files") or []
    if files:
        names = ", ".join(str(item.get("path")) for item in files[:20])
        shown += f"\nwith {len(files)} file(s) sent in: {names}" + (" …" if len(files) > 20 else "")
    if arguments.get("workspace"):
        shown += f"\nin workspace {arguments['workspace']}"
    return shown


def approval_needed(
    settings: ApprovalSettings, policy_name: str, tool: str, tool_policy: ToolPolicy, arguments: Mapping[str, Any]
) -> Approval | None:
    """Why this call must be approved first (None when the policy lets it run without asking)."""
    field = reason = None
    if tool in settings.tools:
        field, reason = "approval.tools", f"every call of {tool}"
    elif tool == "execute_command" and settings.commands:
        pattern = _matching(settings.commands, *_command_line(arguments))
        if pattern is not None:
            field, reason = "approval.commands", f"the command matches {pattern!r}"
    if field is None and settings.writable_mounts:
        if tool_policy.writable_mounts:
            shown = ", ".join(f"{m.host_path} as {m.sandbox_path}" for m in tool_policy.writable_mounts)
            field, reason = "approval.writable_mounts", f"it can write to the host's {shown}"
    if field is None or reason is None:
        return None
    message = (
        f"Allow {tool} to run this in the sandbox? Policy '{policy_name}' asks a person first "
        f"({field}: {reason}).\n\n{_what_runs(tool, arguments)}"
    )
    return Approval(policy_name, field, reason, message)


def approval_notice(settings: ApprovalSettings, tool: str, tool_policy: ToolPolicy) -> str | None:
    """What a tool's description says of the approvals its calls may need (None: none)."""
    asks = []
    if tool in settings.tools:
        asks.append("every call (approval.tools)")
    elif tool == "execute_command" and settings.commands:
        asks.append(f"commands matching {', '.join(settings.commands)} (approval.commands)")
    if settings.writable_mounts and tool_policy.writable_mounts:
        asks.append("every call, as it can write to host folders (approval.writable_mounts)")
    if not asks:
        return None
    return "A person is asked to approve, through the client, before it runs: " + "; ".join(asks) + "."


def new_question(lapse_s: float) -> str:
    """A question's id: when it lapses (wall-clock seconds, as replicas share it) and 128 random bits."""
    return f"{math.ceil(time.time() + lapse_s)}.{secrets.token_urlsafe(16)}"


def lapses_at(question_id: str) -> float | None:
    """When a question lapses (None for an id this server did not make)."""
    stamp, dot, rest = question_id.partition(".")
    return float(stamp) if dot and stamp.isdigit() and len(stamp) <= 12 and len(rest) >= 16 else None
