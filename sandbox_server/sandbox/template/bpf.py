"""A sandbox's seccomp filter compiled on the host, once per profile, as runc compiles it: the OCI form of the
profile (sandbox.oci.oci_seccomp) through libseccomp into the BPF program the template's children load."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["compiled"]

ACTIONS = {
    "SCMP_ACT_KILL": 0x00000000, "SCMP_ACT_KILL_THREAD": 0x00000000, "SCMP_ACT_KILL_PROCESS": 0x80000000,
    "SCMP_ACT_TRAP": 0x00030000, "SCMP_ACT_ERRNO": 0x00050000, "SCMP_ACT_TRACE": 0x7FF00000,
    "SCMP_ACT_LOG": 0x7FFC0000, "SCMP_ACT_ALLOW": 0x7FFF0000,
}  # fmt: skip
OPERATORS = {
    "SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4, "SCMP_CMP_GE": 5, "SCMP_CMP_GT": 6,
    "SCMP_CMP_MASKED_EQ": 7,
}  # fmt: skip
EPERM = 1
SCMP_FLTATR_CTL_NNP = 3


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]  # fmt: skip


@functools.cache
def _libseccomp() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_arch_remove.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_arch_native.restype = ctypes.c_uint32
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp)
    ]  # fmt: skip
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def _action(name: str, errno: int | None) -> int:
    value = ACTIONS[name]
    if name == "SCMP_ACT_ERRNO":
        value |= EPERM if errno is None else errno
    return value


def _arch(lib: ctypes.CDLL, name: str) -> int:
    return int(lib.seccomp_arch_resolve_name(name.removeprefix("SCMP_ARCH_").lower().encode()))


@functools.cache
def compiled(seccomp_json: str) -> bytes:
    """The BPF program of an OCI `linux.seccomp` (given as JSON, so that it is cached by its text)."""
    return _compile(json.loads(seccomp_json))


def _compile(seccomp: Mapping[str, Any]) -> bytes:
    lib = _libseccomp()
    default = _action(seccomp["defaultAction"], seccomp.get("defaultErrnoRet"))
    ctx = lib.seccomp_init(default)
    if not ctx:
        raise OSError("libseccomp could not make a filter")
    try:
        lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_NNP, 0)  # the child sets no_new_privs itself
        arches = [_arch(lib, name) for name in seccomp.get("architectures") or []]
        native = int(lib.seccomp_arch_native())
        for arch in arches:
            if arch != native:
                lib.seccomp_arch_add(ctx, arch)
        if arches and native not in arches:
            lib.seccomp_arch_remove(ctx, native)
        for rule in seccomp.get("syscalls") or []:
            action = _action(rule["action"], rule.get("errnoRet"))
            if action == default:
                continue  # as runc: a rule saying what the default says adds nothing
            for name in rule["names"]:
                number = lib.seccomp_syscall_resolve_name(name.encode())
                if number < 0:
                    continue  # not a call this kernel's libseccomp knows
                _add(lib, ctx, action, number, rule.get("args") or [])
        reader, writer = os.pipe()
        try:
            if lib.seccomp_export_bpf(ctx, writer) < 0:
                raise OSError("libseccomp could not export the filter")
            os.close(writer)
            writer = -1
            program = b""
            while chunk := os.read(reader, 1 << 16):
                program += chunk
        finally:
            os.close(reader)
            if writer >= 0:
                os.close(writer)
        return program
    finally:
        lib.seccomp_release(ctx)


def _add(lib: ctypes.CDLL, ctx: int, action: int, number: int, args: list[Mapping[str, Any]]) -> None:
    """One rule, its argument conditions all holding; conditions on the same argument each a rule of its own
    (either may hold), as runc adds them."""
    indices = [int(a["index"]) for a in args]
    groups = [args] if len(set(indices)) == len(indices) else [[a] for a in args]
    for group in groups:
        conditions = (_ArgCmp * max(1, len(group)))()
        for i, arg in enumerate(group):
            conditions[i] = _ArgCmp(int(arg["index"]), OPERATORS[arg["op"]], int(arg.get("value", 0)),
                                    int(arg.get("valueTwo", 0)))  # fmt: skip
        if lib.seccomp_rule_add_array(ctx, action, number, len(group), conditions) < 0:
            raise OSError(f"libseccomp refused a rule for system call {number}")
