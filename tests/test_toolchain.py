"""The toolchain image, under the `toolchain` policy: programs in C, C++, Go, Rust, Java, Python and Node.js built
and run in one call each; a small C library built and checked with `make check`; a Python package with a C
extension built by pip from an allow-listed index (the test's own) and its tests run."""

from __future__ import annotations

import hashlib
import io
import tarfile
import uuid
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.mcp_harness import connect, stdio_parameters, text_of
from tests.upstreams import Upstreams, upstreams_fixture

pytestmark = pytest.mark.anyio
__all__ = ["upstreams_fixture"]

PROGRAMS = {
    "C": ("hello.c", '#include <stdio.h>\nint main(void) { printf("hello from C\\n"); return 0; }\n',
          "gcc -O2 -Wall -Werror -o hello hello.c && ./hello"),
    "C++": ("hello.cpp", '#include <iostream>\nint main() { std::cout << "hello from C++" << std::endl; }\n',
            "g++ -O2 -Wall -Werror -o hello hello.cpp && ./hello"),
    "Go": ("hello.go", 'package main\nimport "fmt"\nfunc main() { fmt.Println("hello from Go") }\n', "go run hello.go"),
    "Rust": ("hello.rs", 'fn main() { println!("hello from Rust"); }\n', "rustc -O hello.rs && ./hello"),
    "Java": ("Hello.java",
             'public class Hello { public static void main(String[] a) { System.out.println("hello from Java"); } }\n',
             "javac Hello.java && java Hello"),
    "Python": ("hello.py", 'print("hello from Python")\n', "python3 hello.py"),
    "Node.js": ("hello.js", 'console.log("hello from Node.js")\n', "node hello.js"),
}  # fmt: skip

RING_H = """\
#ifndef RING_H
#define RING_H
#include <stddef.h>
typedef struct { int *items; size_t size, head, count; } ring;
int ring_init(ring *r, size_t size);
void ring_free(ring *r);
int ring_push(ring *r, int value);   /* 0, or -1 when full */
int ring_pop(ring *r, int *value);   /* 0, or -1 when empty */
#endif
"""
RING_C = """\
#include <stdlib.h>
#include "ring.h"
int ring_init(ring *r, size_t size) {
    r->items = malloc(size * sizeof *r->items); r->size = size; r->head = r->count = 0;
    return r->items ? 0 : -1;
}
void ring_free(ring *r) { free(r->items); r->items = NULL; }
int ring_push(ring *r, int value) {
    if (r->count == r->size) return -1;
    r->items[(r->head + r->count++) % r->size] = value; return 0;
}
int ring_pop(ring *r, int *value) {
    if (r->count == 0) return -1;
    *value = r->items[r->head]; r->head = (r->head + 1) % r->size; r->count--; return 0;
}
"""
RING_TEST = """\
#include <stdio.h>
#include "ring.h"
static int failed, run;
#define CHECK(c) do { run++; if (!(c)) { failed++; printf("FAIL line %d: %s\\n", __LINE__, #c); } } while (0)
int main(void) {
    ring r; int v = 0;
    CHECK(ring_init(&r, 2) == 0);
    CHECK(ring_pop(&r, &v) == -1);
    CHECK(ring_push(&r, 1) == 0 && ring_push(&r, 2) == 0);
    CHECK(ring_push(&r, 3) == -1);
    CHECK(ring_pop(&r, &v) == 0 && v == EXPECTED_FIRST);
    CHECK(ring_push(&r, 3) == 0 && ring_pop(&r, &v) == 0 && v == 2 && ring_pop(&r, &v) == 0 && v == 3);
    ring_free(&r);
    printf("%d of %d checks passed\\n", run - failed, run);
    return failed != 0;
}
"""
MAKEFILE = """\
CFLAGS ?= -O2 -Wall -Wextra -Werror -fPIC
EXPECTED_FIRST ?= 1
all: libring.a libring.so
ring.o: ring.c ring.h
libring.a: ring.o
\t$(AR) rcs $@ $^
libring.so: ring.o
\t$(CC) -shared -o $@ $^
test_ring: test_ring.c libring.a
\t$(CC) $(CFLAGS) -DEXPECTED_FIRST=$(EXPECTED_FIRST) -o $@ test_ring.c libring.a
check: test_ring
\t./test_ring
clean:
\trm -f *.o *.a *.so test_ring
.PHONY: all check clean
"""

SETUP_PY = """\
from setuptools import Extension, setup
setup(name="sqmath", version="1.0", ext_modules=[Extension("sqmath", ["sqmath.c"])])
"""
SQMATH_C = """\
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject *square(PyObject *self, PyObject *args) {
    long n;
    if (!PyArg_ParseTuple(args, "l", &n)) return NULL;
    return PyLong_FromLong(n * n);
}
static PyMethodDef methods[] = {{"square", square, METH_VARARGS, "n * n, in C"}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "sqmath", NULL, -1, methods};
PyMODINIT_FUNC PyInit_sqmath(void) { return PyModule_Create(&module); }
"""
SQMATH_TEST = """\
import unittest, sqmath
class Square(unittest.TestCase):
    def test_square(self):
        self.assertEqual(sqmath.square(7), 49)
    def test_compiled(self):
        self.assertTrue(sqmath.__file__.endswith(".so"), sqmath.__file__)
    def test_rejects_text(self):
        self.assertRaises(TypeError, sqmath.square, "7")
"""


def _files(files: dict[str, str]) -> list[dict[str, str]]:
    return [{"path": path, "content": content} for path, content in files.items()]


async def _run(session: Client, command: str, files: dict[str, str], **more: Any) -> dict[str, Any]:
    result = await session.call_tool("execute_command", {"command": command, "files": _files(files), **more})
    assert result.structured_content is not None, text_of(result)
    return {**result.structured_content, "is_error": result.is_error, "text": text_of(result)}


async def test_the_toolchain_image_builds_and_runs_a_program_in_each_language_in_one_call(
    runtime: DockerRuntime,
) -> None:
    async with connect(stdio_parameters("--policy", "toolchain")) as session:
        for language, (path, source, command) in PROGRAMS.items():
            ran = await _run(session, command, {path: source})
            assert not ran["is_error"] and ran["stdout"] == f"hello from {language}\n", (language, ran["text"])
        # Go's own test runner and cargo build and run what they make under the workspace (/tmp is noexec).
        go_test = await _run(
            session, "cd sq && go mod init example.com/sq >/dev/null 2>&1 && go test ./...",
            {"sq/sq.go": "package sq\nfunc Sq(n int) int { return n * n }\n",
             "sq/sq_test.go": 'package sq\nimport "testing"\nfunc TestSq(t *testing.T) { if Sq(7) != 49 { t.Fatal("7") } }\n'},
        )  # fmt: skip
        assert not go_test["is_error"] and go_test["stdout"].startswith("ok  \texample.com/sq"), go_test["text"]
        cargo = await _run(session, "cargo new --vcs none -q hi && cd hi && cargo run -q", {})
        assert not cargo["is_error"] and cargo["stdout"] == "Hello, world!\n", cargo["text"]


async def test_a_c_library_is_built_and_its_make_check_passes_and_a_broken_check_fails_the_call(
    runtime: DockerRuntime,
) -> None:
    project = {"ring/ring.h": RING_H, "ring/ring.c": RING_C, "ring/test_ring.c": RING_TEST, "ring/Makefile": MAKEFILE}
    async with connect(stdio_parameters("--policy", "toolchain")) as session:
        built = await _run(session, "cd ring && make -s && make -s check && ls libring.a libring.so", project)
        broken = await _run(session, "make -s -B check EXPECTED_FIRST=2", {})  # the session's shell is still in ring
    assert not built["is_error"], built["text"]
    assert built["stdout"] == "6 of 6 checks passed\nlibring.a\nlibring.so\n", built["stdout"]
    assert broken["is_error"] and broken["exit_code"] == 2, broken["text"]  # make's own code for a failed check
    assert "5 of 6 checks passed" in broken["stdout"] and "FAIL line 11" in broken["stdout"], broken["stdout"]


def _sdist(folder: Path) -> tuple[str, str]:
    """sqmath-1.0.tar.gz: a package with a C extension, as `python -m build --sdist` would leave it."""
    members = {
        "setup.py": SETUP_PY,
        "sqmath.c": SQMATH_C,
        "PKG-INFO": "Metadata-Version: 2.1\nName: sqmath\nVersion: 1.0\n",
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(f"sqmath-1.0/{name}")
            info.size, info.mode = len(data), 0o644
            archive.addfile(info, io.BytesIO(data))
    filename = "sqmath-1.0.tar.gz"
    (folder / "files" / filename).write_bytes(buffer.getvalue())
    (folder / "files" / filename).chmod(0o644)
    sha256 = hashlib.sha256(buffer.getvalue()).hexdigest()
    (folder / "simple" / "sqmath").mkdir(mode=0o755, exist_ok=True)
    page = folder / "simple" / "sqmath" / "index.html"
    page.write_text(f'<a href="/files/{filename}#sha256={sha256}">{filename}</a>\n')
    page.chmod(0o644)
    return filename, sha256


async def test_pip_builds_a_c_extension_from_an_allow_listed_index_and_its_tests_pass(
    tmp_path: Path, runtime: DockerRuntime, upstreams: Upstreams
) -> None:
    _sdist(upstreams.index_folder)
    policy = tmp_path / "coding.yaml"
    policy.write_text(
        "extends: toolchain\nname: coding\ntools:\n  execute_command:\n    network:\n"
        f"      allow: ['index.test:80']\n      egress_network: {upstreams.network}\n"
        f"      hosts: {{index.test: {upstreams.index}}}\n"
        "    env:\n      set: {PIP_INDEX_URL: 'http://index.test/simple/', PIP_TRUSTED_HOST: index.test}\n"
    )
    marker = uuid.uuid4().hex[:8]
    async with connect(stdio_parameters("--policy", str(policy))) as session:
        installed = await _run(
            session, f"pip install -q --no-build-isolation sqmath && python3 -m unittest -q test_sqmath && echo {marker}",
            {"test_sqmath.py": SQMATH_TEST}, timeout_s=300,
        )  # fmt: skip
    assert not installed["is_error"], installed["text"]
    assert installed["stdout"].strip() == marker and "Ran 3 tests" in installed["stderr"], installed["text"]
    requests = [(r["host"], r["status"]) for r in installed.get("network", {}).get("requests", [])]
    assert ("index.test", 200) in requests and all(host == "index.test" for host, _ in requests), requests


async def test_the_toolchains_are_current_and_uv_makes_a_project_offline(runtime: DockerRuntime) -> None:
    """Rust 1.85, Go 1.23, Node.js 22 LTS ahead of Debian's 18, and uv, which sets up a project with no network."""
    async with connect(stdio_parameters("--policy", "toolchain")) as session:
        versions = await _run(session, "rustc --version; cargo --version; go version; node --version; uv --version", {})
        uv = await _run(session, "uv init -q --bare --no-workspace app && cd app && uv run --offline -q main.py",
                        {"app/main.py": "print('Hello from app!')\n"})  # fmt: skip
    lines = versions["stdout"].splitlines()
    assert lines[0].startswith("rustc 1.85.") and lines[1].startswith("cargo 1.85."), lines
    assert lines[2].startswith("go version go1.23.") and lines[3].startswith("v22."), lines
    assert lines[4].startswith("uv 0.13."), lines
    assert not uv["is_error"] and uv["stdout"] == "Hello from app!\n", uv["text"]
