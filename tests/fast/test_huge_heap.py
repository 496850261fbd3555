"""A warm template's heap made huge pages where it is in use (template.kernel.collapse_heap): the process's dense
anonymous memory is, memory it barely uses is left alone, and what it holds is unchanged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROBE = """
import ctypes, mmap, os
from sandbox_server.sandbox.template import kernel
SIZE = 16 << 20
region = mmap.mmap(-1, 3 * SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
base = ctypes.addressof(ctypes.c_char.from_buffer(region))
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
assert libc.mprotect(base + SIZE, SIZE, 0) == 0  # (between the two: a mapping of its own each, as the kernel lists)
dense_at, sparse_at = base, base + 2 * SIZE
for place in range(0, SIZE, 4096):  # every page in use
    region[place] = 7
for place in range(2 * SIZE, 3 * SIZE, 64 << 10):  # one page in 16
    region[place] = 7
def huge_kib(address):
    found = None
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:
            low, high = (int(bound, 16) for bound in fields[0].split("-"))
            found = low <= address < high
        elif found and fields[0] == "AnonHugePages:":
            return int(fields[1])
made = kernel.collapse_heap(os.open("/proc/self/maps", os.O_RDONLY))
assert all(region[place] == 7 for place in range(0, SIZE, 4096))
assert region[2 * SIZE] == 7 and region[2 * SIZE + 4096] == 0
print(made, huge_kib(dense_at), huge_kib(sparse_at))
"""


def test_dense_anonymous_memory_becomes_huge_pages_and_sparse_memory_does_not() -> None:
    said = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2]
    ).stdout.split()
    made, dense_kib, sparse_kib = (int(word) for word in said)
    if "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        assert made == dense_kib == 0  # (the kernel will not: nothing changes, nothing fails)
        return
    assert dense_kib >= 14 << 10, said  # (16 MiB, 2 MiB aligned: 14 at least)
    assert made >= 14, said
    assert sparse_kib == 0, said  # made whole, it would take 16 times the memory it uses
