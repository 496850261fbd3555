"""The sandbox's process made unprivileged for good: no capability in any set (the bounding set emptied), its
user and groups the config's, no new privileges (no setuid bit, no file capability can give any back)."""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from typing import Any

from . import kernel


def drop_bounding() -> None:
    """Every capability out of the bounding set (while this process still has CAP_SETPCAP), and none ambient: each
    one the kernel knows, up to the first it calls invalid (no /proc needed: a warm template's root has none). One
    already out is left alone: each drop commits new credentials, which a read does not (a warm template empties its
    own set once, and the processes it forks find nothing left to drop)."""
    cap = 0
    while (held := _in_bounding(cap)) is not None:
        if held:
            kernel.prctl(kernel.PR_CAPBSET_DROP, cap)
        cap += 1
    kernel.prctl(kernel.PR_CAP_AMBIENT, kernel.PR_CAP_AMBIENT_CLEAR_ALL)


def _in_bounding(cap: int) -> bool | None:
    """Whether `cap` is in this process's bounding set; None past the last capability the kernel knows."""
    try:
        return bool(kernel.prctl(kernel.PR_CAPBSET_READ, cap))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


def become(user: Mapping[str, Any]) -> None:
    """The config's user: its groups, its gid, its uid (leaving uid 0 empties the effective and permitted sets),
    then every set emptied, the inheritable one included."""
    uid, gid = int(user["uid"]), int(user["gid"])
    os.setgroups([int(g) for g in user.get("additionalGids", [])])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    kernel.capset_none()


def no_new_privileges() -> None:
    kernel.prctl(kernel.PR_SET_NO_NEW_PRIVS, 1)
