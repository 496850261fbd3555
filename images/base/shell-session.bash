# The session shell of execute_command in a kept workspace (sandbox_server/tools/shell_session.py says what
# it does and why). In the project's images bash reads it as its BASH_ENV, the call's flags in SANDBOX_SHELL,
# before it runs the caller's command line (`bash -c`); elsewhere it comes inline, with the command line as $1 and
# the flags as $2, and runs the command itself.
__sbx_state=/workspace/.sandbox/shell.sh __sbx_t=/tmp/.sandbox/shell
if [ -n "${SANDBOX_SHELL+set}" ]; then
    __sbx_cmd= __sbx_flags=$SANDBOX_SHELL
    unset -v BASH_ENV SANDBOX_SHELL
else
    __sbx_cmd=$1 __sbx_flags=$2
    set --
fi
export -p >"$__sbx_t.env0"
__sbx_so0=$SHELLOPTS __sbx_bo0=$BASHOPTS
# What saves the state, run only when the call changed it: a literal (a here-document would be read from a pipe
# a byte at a time, on every call).
__sbx_full='
__sbx_vars() {
    local line name
    while IFS= read -r line; do
        [[ $line == "declare -"* ]] || continue
        name=${line#declare -* } name=${name%%=*}
        [[ $line == *=\"*\" || $line != *=* ]] || line=
        __sbx_seen[$name]=$line
    done <"$1"
}
declare -A __sbx_seen __sbx_old
__sbx_vars "$__sbx_t.env0"
for __sbx_n in "${!__sbx_seen[@]}"; do __sbx_old[$__sbx_n]=${__sbx_seen[$__sbx_n]}; done
__sbx_seen=()
export -p >"$__sbx_t.env1"
__sbx_vars "$__sbx_t.env1"
unset -f __sbx_vars
{
    for __sbx_n in "${!__sbx_seen[@]}"; do
        case $__sbx_n in PWD|OLDPWD|SHLVL|_) continue ;; esac
        [[ -n ${__sbx_old[$__sbx_n]-} && ${__sbx_old[$__sbx_n]} == "${__sbx_seen[$__sbx_n]}" ]] || declare -p -- "$__sbx_n"
    done
    for __sbx_n in "${!__sbx_old[@]}"; do
        [[ -v __sbx_seen[$__sbx_n] ]] || printf "unset -v %q\n" "$__sbx_n"
    done
    declare -f
    alias -p
    for __sbx_n in ${__sbx_bo//:/ }; do [[ :$__sbx_bo0: == *:$__sbx_n:* ]] || printf "shopt -s %s\n" "$__sbx_n"; done
    for __sbx_n in ${__sbx_bo0//:/ }; do [[ :$__sbx_bo: == *:$__sbx_n:* ]] || printf "shopt -u %s\n" "$__sbx_n"; done
    if [ -n "$__sbx_workdir" ]; then
        [ -n "$__sbx_home" ] && printf "__sbx_cwd=%q\n" "$__sbx_home"
    else
        case $PWD in /workspace|/workspace/*) printf "__sbx_cwd=%q\n" "$PWD" ;; esac
    fi
    printf "__sbx_so=%q\n" "$__sbx_so"
} >"$__sbx_state"
'
case $__sbx_flags in *reset*) : >"$__sbx_state" ;; esac 2>/dev/null
[ -d "${__sbx_state%/*}" ] || mkdir -p -- "${__sbx_state%/*}" 2>/dev/null
trap '{
    __sbx_rc=$? __sbx_so=$SHELLOPTS __sbx_bo=$BASHOPTS
    { export -p; declare -f; alias -p; printf "%s\n" "$PWD" "$__sbx_so" "$__sbx_bo"; } >"$__sbx_t.end"
    set +eu +o pipefail
    read -r -d "" __sbx_a <"$__sbx_t.begin"; read -r -d "" __sbx_b <"$__sbx_t.end"
    [[ $__sbx_a == "$__sbx_b" ]] || eval "$__sbx_full"
    exit "$__sbx_rc"
} 2>/dev/null' EXIT
__sbx_cwd= __sbx_so=
shopt -s expand_aliases
[ -r "$__sbx_state" ] && . "$__sbx_state" 2>/dev/null
__sbx_workdir= __sbx_home=$__sbx_cwd
case $__sbx_flags in
    *workdir*) __sbx_workdir=1 ;;
    *) [ -n "$__sbx_cwd" ] && cd -- "$__sbx_cwd" 2>/dev/null ;;
esac
__sbx_so=${__sbx_so:-$SHELLOPTS}
{ export -p; declare -f; alias -p; printf '%s\n' "$PWD" "$__sbx_so" "$BASHOPTS"; } >"$__sbx_t.begin" 2>/dev/null
__sbx_x=
for __sbx_n in ${SHELLOPTS//:/ }; do [[ :$__sbx_so: == *:$__sbx_n:* ]] || set +o "$__sbx_n"; done
for __sbx_n in ${__sbx_so//:/ }; do
    case $__sbx_n in xtrace) __sbx_x='set -x; ' ;; *) [[ :$SHELLOPTS: == *:$__sbx_n:* ]] || set -o "$__sbx_n" ;; esac
done
unset __sbx_n __sbx_cwd
if [ -n "$__sbx_cmd" ]; then eval "$__sbx_x$__sbx_cmd"; else eval "$__sbx_x"; fi
