"""The call's cgroup, joined before any namespace is made: the host made it with the call's limits and handed
over its `cgroup.procs` of each hierarchy, open; the sandbox's cgroup namespace is then rooted there."""

from __future__ import annotations

import os
from collections.abc import Sequence


def join(procs: Sequence[int]) -> None:
    me = str(os.getpid()).encode()
    for fd in procs:
        os.write(fd, me)
        os.close(fd)
