"""The file and its container, as analyze_csv meets them: where it really is, how it is encoded,
and how many threads and how much memory DuckDB may use here.
"""

import codecs
import math
import os

from csv_values import Refusal


def inside(path, root):
    return path == root or path.startswith(root.rstrip("/") + "/")


def resolve(path, roots):
    """The real path of the file to read, which must stay under one of the roots."""
    real = os.path.realpath(path)
    real_roots = [os.path.realpath(root) for root in roots]
    if not any(inside(real, root) for root in real_roots):
        raise Refusal(
            f"refused: {path} resolves to {real}, outside the readable roots ({', '.join(roots)}); "
            "a symbolic link may not lead out of them",
            "filepath",
        )
    if not os.path.exists(real):
        raise Refusal(f"{path} does not exist (readable roots: {', '.join(roots)})", "filepath")
    if not os.path.isfile(real):
        raise Refusal(f"{path} is not a regular file", "filepath")
    return real


def looks_like_text(text):
    """True when control characters other than tab and line ends are rare (not binary data)."""
    controls = sum(1 for char in text if not char.isprintable() and char not in "\t\r\n\ufeff")
    return bool(text) and controls <= len(text) // 100


def detect_encoding(path):
    """(duckdb encoding or None to transcode, label for people) from the file's first bytes."""
    with open(path, "rb") as handle:
        head = handle.read(1 << 16)
    if not head:
        raise Refusal(f"{path} is empty (0 bytes): no header and no rows", "filepath")
    if head.startswith(codecs.BOM_UTF8):
        return "utf-8", "UTF-8 with BOM"
    candidates = []
    if head.startswith(codecs.BOM_UTF16_LE):
        candidates = [("utf-16-le", "utf-16", "UTF-16 LE")]
    elif head.startswith(codecs.BOM_UTF16_BE):
        candidates = [("utf-16-be", None, "UTF-16 BE")]
    elif b"\x00" in head:
        candidates = [("utf-16-le", "utf-16", "UTF-16 LE (no BOM)"), ("utf-16-be", None, "UTF-16 BE (no BOM)")]
    else:
        try:
            text = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
            found = ("utf-8", "UTF-8")
        except UnicodeDecodeError as exc:
            text = head.decode("latin-1")
            found = ("latin-1", f"Latin-1 (not UTF-8: byte 0x{head[exc.start]:02x} at offset {exc.start})")
        if looks_like_text(text):
            return found
    for codec, engine_name, label in candidates:
        text = codecs.getincrementaldecoder(codec)(errors="replace").decode(head, final=False)
        if "\ufffd" not in text and looks_like_text(text):
            return engine_name, label
    why = "it holds NUL bytes" if b"\x00" in head else "it holds many control characters"
    raise Refusal(
        f"{path} does not look like a text CSV: its first bytes are not UTF-8, UTF-16 or Latin-1 text ({why})",
        "filepath",
    )


def transcode_utf16_be(path):
    """A UTF-8 copy of a big-endian UTF-16 file (DuckDB reads only little-endian UTF-16)."""
    target = "/tmp/transcoded.csv"
    with open(path, encoding="utf-16-be") as source, open(target, "w", encoding="utf-8") as sink:
        first = source.read(1)
        if first != "\ufeff":
            sink.write(first)
        while block := source.read(1 << 20):
            sink.write(block)
    return target


def cgroup_value(*candidates):
    for candidate in candidates:
        try:
            with open(candidate) as handle:
                return handle.read().split()
        except OSError:
            continue
    return None


def engine_settings():
    """DuckDB threads and memory from the container's cgroup limits."""
    memory = cgroup_value("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
    limit = int(memory[0]) if memory and memory[0].isdigit() else 1 << 30
    limit = min(limit, 1 << 40)
    threads = 1
    quota = cgroup_value("/sys/fs/cgroup/cpu.max")
    if quota and quota[0].isdigit():
        threads = math.ceil(int(quota[0]) / int(quota[1]))
    else:
        v1_quota = cgroup_value("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us")
        v1_period = cgroup_value("/sys/fs/cgroup/cpu/cpu.cfs_period_us", "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us")
        if v1_quota and v1_period and int(v1_quota[0]) > 0:
            threads = math.ceil(int(v1_quota[0]) / int(v1_period[0]))
        else:
            threads = os.cpu_count() or 1
    return max(1, threads), max(64 << 20, limit // 2), limit
