"""The server process's own memory: what it frees goes back to the host.

Call arguments of several megabytes are allocated and freed in bursts (a client sending many calls at once). glibc's
malloc serves large blocks with mmap, which it returns at once when they are freed, but after the first such free
it raises its threshold up to 32 MiB ("dynamic mmap threshold"), so that later blocks of a few megabytes come from
its heap, which keeps them after they are freed: the resident size stayed hundreds of megabytes above its level
after a client left. Fixing the threshold keeps every block above it on mmap, returned when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["MMAP_THRESHOLD_BYTES", "return_freed_memory"]

log = logging.getLogger("sandbox_server")

MMAP_THRESHOLD_BYTES = 128 * 1024
"""Blocks from this size on are mapped on their own and unmapped when freed (glibc's initial threshold, fixed)."""
_M_MMAP_THRESHOLD = -3
"""mallopt's parameter number for the threshold (malloc.h); setting it turns the dynamic threshold off."""


def return_freed_memory() -> bool:
    """Fix malloc's mmap threshold (glibc only; elsewhere nothing changes): whether it was set."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): its allocator is left as it is
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if not done:
        log.info("could not fix malloc's mmap threshold; freed memory may stay with the process")
    return done
