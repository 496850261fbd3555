"""Where the cgroup2 hierarchy is mounted and whether a move into a cgroup waits for the kernel's grace period there
(favordynmods), as /proc/self/mountinfo says it: what `setup` remounts and what the server tells when it is not."""

from __future__ import annotations

from sandbox_server.sandbox.template.cgroups import FAVOR_MOVES, moves_mount

HYBRID = """\
31 1 0:30 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


def test_the_unified_hierarchy_beside_v1s_is_found_and_said_not_favoured() -> None:
    assert moves_mount(HYBRID) == ("/sys/fs/cgroup/unified", False)


def test_the_option_is_read_from_the_super_options_among_others() -> None:
    v2 = "35 24 0:30 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate,favordynmods,memory_recursiveprot\n"
    assert moves_mount(v2) == ("/sys/fs/cgroup", True)
    assert FAVOR_MOVES == "favordynmods"


def test_v1_alone_or_a_name_that_only_looks_like_it_is_no_cgroup2() -> None:
    v1 = HYBRID.splitlines()[1] + "\n50 31 0:40 / /mnt/cgroup2 rw - ext4 /dev/vda1 rw,favordynmods\n"
    assert moves_mount(v1) is None
    assert moves_mount("") is None
