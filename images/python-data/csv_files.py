"""The file and its container, as analyze_csv meets them: where it really is, how it is encoded,
and how many threads and how much memory DuckDB may use here.
"""

import codecs
import math
import os
import re
import unicodedata

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
    """True when characters that are neither printable nor spaces are rare in the first 64 Ki (not binary
    data; a no-break space between thousands is text)."""
    text = text[: 1 << 16]
    odd = sum(1 for char in text if not char.isprintable() and not char.isspace() and char != "\ufeff")
    return bool(text) and odd <= len(text) // 100


SAMPLE_BYTES = 1 << 20
"""How much of the (decompressed) file detection reads: never the whole of a big file."""
NATIVE = {"utf_8": "utf-8", "utf_16_le": "utf-16", "iso8859_1": "latin-1"}
"""Python codecs DuckDB reads itself (its names); any other is converted to UTF-8 as a stream."""
GZIP_MAGIC, ZSTD_MAGIC = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"
BOMS = (
    (codecs.BOM_UTF32_LE, "utf_32_le", "UTF-32 LE with BOM"),
    (codecs.BOM_UTF32_BE, "utf_32_be", "UTF-32 BE with BOM"),
    (codecs.BOM_UTF8, "utf_8", "UTF-8 with BOM"),
    (codecs.BOM_UTF16_LE, "utf_16_le", "UTF-16 LE with BOM"),
    (codecs.BOM_UTF16_BE, "utf_16_be", "UTF-16 BE with BOM"),
)


class Encoding:
    """What the file is: its compression, its Python codec, and what to tell people (with how sure, for a guess)."""

    def __init__(self, codec, label, compression=None):
        self.codec = codecs.lookup(codec).name.replace("-", "_")
        self.label = label
        self.compression = compression

    @property
    def native(self):
        """DuckDB's name for the encoding when it reads this file itself, else None."""
        return NATIVE.get(self.codec)


def open_raw(path, compression):
    """The file's bytes, decompressed as a stream."""
    if compression == "gzip":
        import gzip

        return gzip.open(path, "rb")
    if compression == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
    return open(path, "rb")


def _magic(path):
    """The file's first four bytes, which say what kind of file it is."""
    with open(path, "rb") as handle:
        return handle.read(4)


def compression_of(path):
    magic = _magic(path)
    if magic.startswith(GZIP_MAGIC):
        return "gzip"
    if magic.startswith(ZSTD_MAGIC):
        return "zstd"
    return None


def detect_encoding(path, explicit=None):
    """The file's Encoding, from a bounded sample of its (decompressed) start; `explicit` (a codec name) wins."""
    compression = compression_of(path)
    with open_raw(path, compression) as handle:
        head = handle.read(SAMPLE_BYTES)
    if not head:
        raise Refusal(f"{path} is empty (0 bytes): no header and no rows", "filepath")
    if explicit:
        try:
            return Encoding(explicit, f"{codecs.lookup(explicit).name} (as asked)", compression)
        except LookupError:
            raise Refusal(
                f"encoding {explicit!r} is not an encoding Python knows (try gb18030, big5, cp1252)", "encoding"
            ) from None
    for bom, codec, label in BOMS:
        if head.startswith(bom):
            return Encoding(codec, label, compression)
    if b"\x00" in head:
        for codec, label in (
            ("utf_16_le", "UTF-16 LE (no BOM)"),
            ("utf_16_be", "UTF-16 BE (no BOM)"),
            ("utf_32_le", "UTF-32 LE (no BOM)"),
            ("utf_32_be", "UTF-32 BE (no BOM)"),
        ):
            text = codecs.getincrementaldecoder(codec)(errors="replace").decode(head, final=False)
            # Any bytes decode as UTF-16 to some characters: a table also has a line break or a delimiter.
            shaped = any(mark in text for mark in "\n,;\t|")
            if "\ufffd" not in text and shaped and looks_like_text(text):
                return Encoding(codec, label, compression)
        raise Refusal(
            f"{path} does not look like a text CSV: its first bytes hold NUL bytes and are not UTF-16 or UTF-32 text",
            "filepath",
        )
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        found = Encoding("utf_8", "UTF-8" if not text.isascii() else "ASCII (read as UTF-8)", compression)
    except UnicodeDecodeError as exc:
        found = _guess(head, exc, compression)
        text = head.decode(found.codec, "replace")
    if looks_like_text(text):
        return found
    raise Refusal(
        f"{path} does not look like a text CSV: its first bytes are not text in any encoding tried "
        "(it holds many control characters); a gzip or zstd file is read whole, other containers are not",
        "filepath",
    )


SINGLE_BYTE = (
    ("cp1252", "LATIN"),
    ("cp1250", "LATIN"),
    ("cp1257", "LATIN"),
    ("cp1254", "LATIN"),
    ("cp1258", "LATIN"),
    ("cp1251", "CYRILLIC"),
    ("cp1253", "GREEK"),
    ("cp1255", "HEBREW"),
    ("cp1256", "ARABIC"),
)
"""The single-byte encodings of Windows' exports, Western European first: a file whose bytes read as
Western European text is read so, as browsers and Excel decide."""
MARKS = set("€–—‘’‚“”„«»…°·§©®±×÷¢£¥µ¼½¾\u00a0")
"""Non-letters text in these encodings holds; a Polish file read as Western European shows others (`³`, `¹`, `¿`
between letters)."""
NOT_WESTERN = set("þÞðÐýÝ")
"""Letters only Icelandic (and Faroese) write, which Turkish and Baltic bytes become when read as Western."""
FOREIGN_SHARE = 0.4
"""At most this share of a Latin-script text's letters is outside ASCII (German, French, Polish: under 0.15); text
of another script read as Latin letters is nearly all of them."""


def _reading(head, codec):
    try:
        return codecs.getincrementaldecoder(codec)().decode(head, final=False)
    except UnicodeDecodeError:
        return None


def _plausible(text, script):
    """Whether a reading looks like text of its script: each character outside ASCII a letter of that script or a
    mark such text uses; a Latin reading mostly ASCII letters, and a Western one without Icelandic's letters."""
    odd = [char for char in text if not char.isascii() and unicodedata.category(char) != "Mn"]  # (tones: cp1258)
    letters = [char for char in odd if char.isalpha()]
    if any(not char.isalpha() and char not in MARKS for char in odd):
        return False
    if any(script not in unicodedata.name(char, "") for char in letters):
        return False
    if script == "LATIN":
        share = len(letters) / max(1, len(letters) + sum(char.isascii() and char.isalpha() for char in text))
        return share <= FOREIGN_SHARE
    words = re.findall(r"[^\W\d_]+", text)
    mixed = sum(1 for word in words if not word.isascii() and any(char.isascii() for char in word))
    return mixed <= 0.1 * max(1, sum(1 for word in words if not word.isascii()))  # `Thьringen`: Latin bytes


def _guess(head, utf8_error, compression):
    """Not UTF-8. A multi-byte encoding (Shift_JIS, GB18030, Big5, EUC-KR) as the detector (charset-normalizer)
    finds it, among its cleanest readings the one most like a language. Else a single-byte encoding whose
    reading looks like text of its script: Windows-1252 whenever it does (the detector alone reads a German
    Latin-1 export as cp775 or cp1250), else the one the detector scores best. The label names those that read
    the sample otherwise, as runners-up (one reading alike is no alternative)."""
    from charset_normalizer import from_bytes

    matches = list(from_bytes(head))
    where = f"byte 0x{head[utf8_error.start]:02x} at offset {utf8_error.start} is not UTF-8"
    wide = [m for m in matches if m.multi_byte_usage > 0]
    if matches and matches[0].multi_byte_usage > 0:
        clean = [m for m in wide if m.chaos <= matches[0].chaos + 0.1]
        chosen = max(clean, key=lambda m: m.coherence)  # (max keeps the first of equals: the detector's order)
        codec = codecs.lookup(chosen.encoding).name
        if codec in ("gbk", "gb2312"):
            codec = "gb18030"  # the superset: every GBK file is GB18030
        others = sorted({codecs.lookup(m.encoding).name for m in clean} - {codec, "gbk", "gb2312"})
    else:
        readings = {codec: _reading(head, codec) for codec, _ in SINGLE_BYTE}
        plausible = [codec for codec, script in SINGLE_BYTE if readings[codec] and _plausible(readings[codec], script)]
        ranked = [codecs.lookup(m.encoding).name for m in matches]
        scores = {codecs.lookup(m.encoding).name: (m.chaos, -m.coherence) for m in reversed(matches)}
        if "cp1252" in plausible and not set(readings["cp1252"]) & NOT_WESTERN:
            codec = "cp1252"
        elif plausible:  # the cleanest reading, then the one most like a language, as the detector scores them
            codec = min(plausible, key=lambda c: scores.get(c, (1.0, 0.0)))
        elif matches:
            codec = codecs.lookup(matches[0].encoding).name
        else:
            return Encoding("latin_1", f"Latin-1 ({where}; no better match)", compression)
        text = readings.get(codec) or _reading(head, codec)
        others = sorted({c for c in plausible if c != codec and readings[c] != text})
        if not others and ranked and ranked[0] != codec and _reading(head, ranked[0]) == text:
            where += f"; {ranked[0]} reads it alike"  # the detector's own pick, named all the same
    sure = 1.0 / (1 + len(others))
    also = ""
    if others:
        also = f"; runner{'s' if len(others) > 1 else ''}-up: {', '.join(others)}, which read{'s' if len(others) == 1 else ''} it otherwise"
    label = f"{codec} (detected, {sure:.0%} sure; {where}{also})"
    return Encoding(codec, label, compression)


def container_of(path):
    """ "parquet" or "xlsx" when the file is one (by its first bytes, whatever its name), else None."""
    magic = _magic(path)
    if magic == b"PAR1":
        return "parquet"
    if magic == b"PK\x03\x04":
        import zipfile

        try:
            with zipfile.ZipFile(path) as archive:
                if "xl/workbook.xml" in archive.namelist():
                    return "xlsx"
        except zipfile.BadZipFile:
            return None
    return None


def sheet_names(path):
    import openpyxl

    book = openpyxl.load_workbook(path, read_only=True)
    try:
        return list(book.sheetnames)
    finally:
        book.close()


def _decodes(data, codec):
    try:
        codecs.getincrementaldecoder(codec)().decode(data, final=False)
    except UnicodeDecodeError:
        return False
    return True


class StreamedSource:
    """A FIFO that gives, each time it is opened, the whole of what `produce` writes, as a stream.

    DuckDB reads only UTF-8, UTF-16 LE and Latin-1 text, so a file in another encoding (or
    a workbook) is turned into UTF-8 CSV here, block by block, and written to a FIFO that
    DuckDB reads: nothing is held whole, in memory or on disk. Each reader that opens it gets
    its own whole stream. `produce(sink)` returns an error text when the file cannot be read
    to its end (a byte not in its encoding); the answer is then refused, never computed from
    part of the file.
    """

    def __init__(self, produce, fifo="/tmp/.analyze-csv-source.csv"):
        import threading

        self.produce, self.fifo = produce, fifo
        self.error = None
        self._threading = threading
        os.mkfifo(fifo, 0o600)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        """Once a reader has opened the FIFO, a new FIFO takes its name (atomically), so a later open
        never joins a stream already under way."""
        fresh = self.fifo + ".next"
        while True:
            sink = open(self.fifo, "wb")  # blocks until a reader opens it
            os.mkfifo(fresh, 0o600)
            os.rename(fresh, self.fifo)
            self._threading.Thread(target=self._feed, args=(sink,), daemon=True).start()

    def _feed(self, sink):
        try:
            with sink:
                self.error = self.produce(sink) or self.error
        except OSError:
            pass  # the reader stopped early (it needed only the start)


def transcoding(path, encoding):
    """The file converted to UTF-8 as it is read."""

    def produce(sink):
        with open_raw(path, encoding.compression) as source:
            return _decode(source, sink, encoding.codec)

    return StreamedSource(produce)


def _decode(source, sink, codec):
    decoder = codecs.getincrementaldecoder(codec)()
    lines, first = 0, True
    while True:
        block = source.read(1 << 20)
        try:
            text = decoder.decode(block, final=not block)
        except UnicodeDecodeError as exc:
            line = lines + block.count(b"\n", 0, max(0, exc.start)) + 1
            return (
                f"line {line} is not valid {codec} (bytes {block[exc.start : exc.end]!r}); "
                "the file mixes encodings or is not in this one: give `encoding`, or convert the file"
            )
        if first and text.startswith("\ufeff"):
            text = text[1:]
        first = False
        if text:
            sink.write(text.encode("utf-8"))
        lines += block.count(b"\n")
        if not block:
            return None


DELIMITERS = (",", ";", "\t", "|")
"""The delimiters detection weighs; `delimiter` names any other."""
SAMPLE_ROWS = 2000


def sample_text(path, encoding):
    """The start of the file as text (a bounded sample, its last line possibly cut)."""
    with open_raw(path, encoding.compression) as handle:
        head = handle.read(SAMPLE_BYTES)
    text = head.decode(encoding.codec, "replace").lstrip("\ufeff")
    return text if len(head) < SAMPLE_BYTES else text[: text.rfind("\n") + 1]


ALIKE_ENOUGH = 0.95
"""The share of a sample's rows that must have the same number of fields for a delimiter to be a candidate."""


def detect_delimiter(text, delimiters=DELIMITERS):
    """The delimiter that splits the sample's rows into the same number of fields (at least two), with that number,
    how many rows of the sample have another, and how many lines come before the first row of that width (a
    preamble: a report's title and a blank line above the header); None when no delimiter does.

    A few rows with a field too many or too few do not decide it, as they decide a sniffer that wants every row
    alike: each delimiter that splits 95% of the rows alike (from the first of that width on) is a candidate, and
    the one giving the most fields wins (`10,5` splits a `;` file's every row at its decimal commas into fewer,
    equally regular, fields). The width most rows share decides where the table starts, not the first line."""
    import collections
    import csv
    import io

    candidates = []
    for delimiter in delimiters:
        reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
        rows = []  # (the line a row starts on, 0-based; its width)
        for _ in range(SAMPLE_ROWS):
            start = reader.line_num
            row = next(reader, None)
            if row is None:
                break
            if row and any(cell.strip() for cell in row):
                rows.append((start, len(row)))
        if not rows:
            return None
        fields = collections.Counter(width for _, width in rows).most_common(1)[0][0]
        first = next(index for index, (_, width) in enumerate(rows) if width == fields)
        table = rows[first:]
        alike = sum(1 for _, width in table if width == fields)
        if fields >= 2 and alike / len(table) >= ALIKE_ENOUGH:
            candidates.append((fields, alike / len(table), delimiter, len(table) - alike, rows[first][0]))
    if not candidates:
        return None
    fields, _, delimiter, other, above = max(candidates)
    return delimiter, fields, other, above


def text_rows(path, encoding, delimiter, has_header, skip=0):
    """The file's rows as (line, {column: text}) pairs, decoded as a stream in Python: how a value DuckDB
    stopped at is traced back to the line that holds it (a slow path, taken only on such a value)."""
    import csv
    import io

    codec = "utf_8_sig" if encoding.codec == "utf_8" else encoding.codec
    with io.TextIOWrapper(open_raw(path, encoding.compression), encoding=codec, errors="replace", newline="") as text:
        reader = csv.reader(text, delimiter=delimiter or ",")
        for _ in range(skip):  # the lines above the header
            next(reader, None)
        first = next(reader, [])
        names = [name.lstrip("\ufeff") for name in first] if has_header else [f"column{i}" for i in range(len(first))]
        if not has_header:
            yield reader.line_num, dict(zip(names, first, strict=False))
        for row in reader:
            yield reader.line_num, dict(zip(names, row, strict=False))


def _sheet_cells(path, sheet):
    """One sheet's rows as lists of cell texts (dates and times in ISO form), read as a stream (openpyxl's
    read-only mode)."""
    import openpyxl

    book = openpyxl.load_workbook(path, read_only=True, data_only=True)
    try:
        for row in book[sheet].iter_rows(values_only=True):
            yield ["" if v is None else v.isoformat() if hasattr(v, "isoformat") else str(v) for v in row]
    finally:
        book.close()


def sheet_rows(path, sheet):
    """One sheet's rows as (row number, {column: text}) pairs, the first row naming the columns."""
    rows = _sheet_cells(path, sheet)
    names = next(rows, [])
    for number, row in enumerate(rows, start=2):
        yield number, dict(zip(names, row, strict=False))


def workbook_rows(path, sheet):
    """One sheet of an xlsx workbook as UTF-8 CSV, row by row."""
    import csv
    import io

    def produce(sink):
        text = io.TextIOWrapper(sink, encoding="utf-8", newline="", write_through=True)
        csv.writer(text).writerows(_sheet_cells(path, sheet))
        text.flush()
        text.detach()
        return None

    return StreamedSource(produce)


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
