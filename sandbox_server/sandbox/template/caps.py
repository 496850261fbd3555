"""The sandbox's process made unprivileged for good: no capability in any set (the bounding set emptied), its
user and groups the config's, no new privileges (no setuid bit, no file capability can give any back)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from . import kernel

LAST_CAP_FILE = "/proc/sys/kernel/cap_last_cap"


def drop_bounding() -> None:
    """Every capability out of the bounding set (while this process still has CAP_SETPCAP), and none ambient."""
    with open(LAST_CAP_FILE) as last:
        top = int(last.read())
    for cap in range(top + 1):
        kernel.prctl(kernel.PR_CAPBSET_DROP, cap)
    kernel.prctl(kernel.PR_CAP_AMBIENT, kernel.PR_CAP_AMBIENT_CLEAR_ALL)


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
