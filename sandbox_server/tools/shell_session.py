"""execute_command's shell session in a kept workspace: each call's sandbox is fresh, its shell's state is not.

A coding agent's shell remembers where it is: `cd src` in one call and `make` in the next, an
exported variable, a function, an alias, `set -o pipefail`. Nothing of a call's process lives on
(its sandbox is gone with it), so the state is carried instead. The command runs in bash, in
the same shell that sources the state the previous call left and, when it exits (by reaching
its end or by `exit`), writes the state this call leaves: the exported variables it added,
changed or removed (against the environment it started with, so a policy's or the image's own
values are never overridden by an older copy), its functions, aliases, `set -o` and `shopt`
options, and its working folder when that is under /workspace. Every step is a builtin (no
program is started for it), and the file is the sandbox's own, in the workspace beside the
kept variables of run_python: it follows the workspace when it is forked, branched, exported
and resumed, and the server never reads it. A program replaced by `exec`, or stopped at its
deadline, leaves the state the call found. `reset` starts from a clean shell; `workdir` starts
the call in the folder it names rather than where the last one ended, and leaves the session's folder as it was.
"""

from __future__ import annotations

from sandbox_server.sandbox import wire

__all__ = ["SHELL_STATE", "session_argv"]

SHELL_STATE = ".sandbox/shell.sh"
"""The shell's state, relative to the workspace (a bash script the next call's shell sources)."""

_NAMES = "/tmp/.sandbox/shell-names"
"""A scratch file on the call's own /tmp: a builtin's list, read back with `mapfile` (no subshell)."""

SCRIPT = f"""\
__sbx_state={wire.WORKSPACE}/{SHELL_STATE} __sbx_cmd=$1 __sbx_flags=$2
set --
declare -A __sbx_env0
compgen -e >{_NAMES} && mapfile -t __sbx_names <{_NAMES}
for __sbx_n in "${{__sbx_names[@]}}"; do __sbx_env0[$__sbx_n]=${{!__sbx_n}}; done
__sbx_save() {{
    __sbx_rc=$? __sbx_so=$SHELLOPTS __sbx_bo=$BASHOPTS
    set +eu +o pipefail
    declare -A __sbx_now
    compgen -e >{_NAMES} && mapfile -t __sbx_names <{_NAMES}
    {{
        for __sbx_n in "${{__sbx_names[@]}}"; do
            __sbx_now[$__sbx_n]=1
            case $__sbx_n in PWD|OLDPWD|SHLVL|_|__sbx_*) continue ;; esac
            if [[ ! -v __sbx_env0[$__sbx_n] || ${{__sbx_env0[$__sbx_n]}} != "${{!__sbx_n}}" ]]; then
                declare -p -- "$__sbx_n"
            fi
        done
        for __sbx_n in "${{!__sbx_env0[@]}}"; do
            [[ -v __sbx_now[$__sbx_n] ]] || printf 'unset -v %q\\n' "$__sbx_n"
        done
        unset -f __sbx_save
        declare -f
        alias -p
        if [ -n "$__sbx_workdir" ]; then
            [ -n "$__sbx_home" ] && printf '__sbx_cwd=%q\\n' "$__sbx_home"
        else
            case $PWD in {wire.WORKSPACE}|{wire.WORKSPACE}/*) printf '__sbx_cwd=%q\\n' "$PWD" ;; esac
        fi
        printf '__sbx_so=%q __sbx_bo=%q\\n' "$__sbx_so" "$__sbx_bo"
    }} >"$__sbx_state"
    return "$__sbx_rc"
}}
case $__sbx_flags in *reset*) : >"$__sbx_state" ;; esac 2>/dev/null
[ -d "${{__sbx_state%/*}}" ] || mkdir -p -- "${{__sbx_state%/*}}" 2>/dev/null
trap '{{ __sbx_save; }} 2>/dev/null' EXIT
__sbx_cwd= __sbx_so= __sbx_bo=
shopt -s expand_aliases
[ -r "$__sbx_state" ] && . "$__sbx_state" 2>/dev/null
__sbx_workdir= __sbx_home=$__sbx_cwd
case $__sbx_flags in
    *workdir*) __sbx_workdir=1 ;;  # a folder of its own: the session's stays where it was for the next call
    *) [ -n "$__sbx_cwd" ] && cd -- "$__sbx_cwd" 2>/dev/null ;;
esac
if [ -n "$__sbx_bo" ]; then
    for __sbx_n in ${{BASHOPTS//:/ }}; do [[ :$__sbx_bo: == *:$__sbx_n:* ]] || shopt -u "$__sbx_n"; done
    shopt -s ${{__sbx_bo//:/ }} 2>/dev/null
fi
__sbx_x=
if [ -n "$__sbx_so" ]; then
    for __sbx_n in ${{SHELLOPTS//:/ }}; do [[ :$__sbx_so: == *:$__sbx_n:* ]] || set +o "$__sbx_n"; done
    for __sbx_n in ${{__sbx_so//:/ }}; do
        case $__sbx_n in xtrace) __sbx_x='set -x; ' ;; *) set -o "$__sbx_n" ;; esac
    done
fi
unset __sbx_so __sbx_bo __sbx_names __sbx_n __sbx_cwd
eval "$__sbx_x$__sbx_cmd"
"""
"""The session's shell: $1 is the caller's command line, $2 the call's flags (`workdir`, `reset`)."""

_NO_BASH = (
    'command -v bash >/dev/null 2>&1 && exec bash -c "$3" "$0" "$1" "$2"; '
    'echo "sandbox: no bash in this image: the shell\'s state is not carried" >&2; exec /bin/sh -c "$1"'
)
"""An image of another maker's may hold no bash: then the command runs as a plain `sh -c`, and says so."""


def _ours(image: str) -> bool:
    """An image of this project's own catalog (Debian, with bash), not a team's."""
    return image.startswith("sandbox-server/") and not image.startswith("sandbox-server/team-")


def session_argv(command: str, image: str, workdir: bool, reset: bool) -> tuple[str, ...]:
    """The argv that runs `command` in the workspace's shell session."""
    flags = " ".join(flag for flag, asked in (("workdir", workdir), ("reset", reset)) if asked)
    if _ours(image):
        return ("/bin/bash", "-c", SCRIPT, "/bin/bash", command, flags)
    return ("/bin/sh", "-c", _NO_BASH, "/bin/bash", command, flags, SCRIPT)
