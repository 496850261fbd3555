"""A warm interpreter: the data libraries imported before any call exists, then one program run.

The shell launcher starts this in a warm container before its request arrives (when the
container's environment names modules in SANDBOX_PRELOAD), so nothing of any call is in it
while it imports. It then waits on a FIFO for the one job of its container: the launcher
writes the folder holding the program's argv, environment, working folder and stdin, and
this process becomes that program (`python3 SCRIPT ARGS…`), in a process group of its own,
with the call's stdin, environment and folder, and exits with its exit code. It is never
reused: the container is destroyed after its one call, as every sandbox is.

While importing, its output goes to a file (nothing may reach the attach stream before the
request); a module that cannot be imported is skipped, and the reason kept for `doctor`.
"""

import atexit
import ctypes
import importlib.util
import os
import runpy
import select
import shlex
import sys
import time
from collections.abc import Callable

from sandbox_wire import (
    PRELOAD_ENV,
    REQUEST_DIR,
    WARM_DIR,
    WARM_DONE,
    WARM_ERRORS,
    WARM_FORKS_ENV,
    WARM_JOB,
    WARM_STDIN,
)

_started = time.monotonic()
_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_NAME, PR_GET_NAME = 15, 16


def _preload(called: Callable[[], bool]) -> None:
    """Import the modules SANDBOX_PRELOAD names, in their order, until a call comes: what is left then is the
    program's to import if it uses it (a call never waits for a library it does not use)."""
    from sandbox_figures import seed_font_cache

    seed_font_cache()
    saved = os.dup(1), os.dup(2)
    quiet = os.open(WARM_ERRORS, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    try:
        for name in os.environ.get(PRELOAD_ENV, "").split():
            if called():
                print(f"a call came: {name} and what follows it are left to the program", file=sys.stderr)
                break
            try:
                __import__(name)
            except BaseException as exc:  # a missing library leaves that call cold, never broken
                print(f"preload {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        if "matplotlib.pyplot" in sys.modules and not called():
            try:
                _rehearse()
            except Exception as exc:  # a first plot then pays for what it would have readied
                print(f"rehearsal: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(f"preloaded in {time.monotonic() - _started:.3f} s", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(quiet)
        for fd in saved:
            os.close(fd)


def preload_template() -> str:
    """A warm template's preload (sandbox-server's template for this image and preload list, in a sandbox of its
    own that never runs a call): what importing said, for each of its sandboxes' WARM_ERRORS."""
    os.makedirs(WARM_DIR, mode=0o700, exist_ok=True)
    _preload(lambda: False)
    with open(WARM_ERRORS, encoding="utf-8", errors="replace") as said:
        return said.read()


def first_process(argv: list, environment: dict, preloaded: str, ready: int, exits: int) -> None:
    """The first process of a sandbox forked from a warm template (never returns). It starts the launcher (`argv`),
    reaps what is left to it as a sandbox's first process does, and ends when the launcher ends or stops to linger
    (the sandbox ends with it). The process that is to become the program the launcher hands over is forked ahead
    of the call: by the template, once this process says it is `ready` (the one copy of a preloaded heap a call
    makes), that process saying its pid and the template its exit code on `exits`, which this one says on
    WARM_DONE; or, from a template that preloads nothing (`ready` is -1), by this process itself, before the
    launcher starts (cheaper than the template's hand-over when there is little to copy)."""
    import signal

    os.makedirs(WARM_DIR, mode=0o700)
    os.mkfifo(WARM_JOB, 0o600)
    os.mkfifo(WARM_DONE, 0o600)
    with open(WARM_ERRORS, "w", encoding="utf-8") as said:
        said.write(preloaded)
    job = os.open(WARM_JOB, os.O_RDWR | os.O_CLOEXEC)  # (its program's read of the job never meets an end of file)
    done = os.open(WARM_DONE, os.O_RDWR | os.O_CLOEXEC)  # the launcher's read never waits for it to open
    woken, wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake)  # a child that ends or stops wakes the wait below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    os.environ.clear()
    os.environ.update(environment)
    program = -1
    told = _Told(done)
    if ready >= 0:
        os.write(ready, b"1")
        os.close(ready)
    else:
        program, exits = _fork_program(told, (job, done, woken, wake))
    launcher = os.posix_spawn(argv[0], argv, {**environment, WARM_FORKS_ENV: "1"})
    while True:
        asked = select.select([woken, exits] if exits >= 0 else [woken], [], [])[0]
        if exits in asked and not told.heard(os.read(exits, 256)):
            os.close(exits)
            exits = -1
        _drain(woken)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG | os.WUNTRACED)
            except ChildProcessError:
                pid, status = 0, 0
            if pid == 0:
                break
            if pid == program and not os.WIFSTOPPED(status):
                told.exited(b"%d" % _exit_code(status))
            elif pid == launcher:
                os._exit(0 if os.WIFSTOPPED(status) else _exit_code(status))


def _fork_program(told: "_Told", theirs: tuple) -> tuple:
    """The process that becomes the program handed over on WARM_JOB, forked by the first process before the
    launcher starts (in a process group of its own), its pid said; it waits for the launcher's word, and ends at
    once when the launcher runs a program of its own (`none`). Its pid and the read end of the pipe on which it
    says its end (`told` hears it there)."""
    heard, says = os.pipe2(os.O_CLOEXEC)
    program = os.fork()
    if program == 0:
        try:
            os.close(heard)
            _keep_exits(says)
            _wait_for_the_program(theirs)
        except BaseException:  # said where the call will read it (else its first process would end the sandbox)
            import traceback

            traceback.print_exc()
            os._exit(125)
        become_program()
    os.close(says)
    try:
        os.setpgid(program, program)  # (also its own first step: the launcher's deadline stops this group)
    except OSError:
        pass
    told.started(b"%d" % program)
    return program, heard


class _Told:
    """What the exits pipe says (`pid N`, then `exit C`), said on WARM_DONE as the launcher reads it: the program's
    pid, then its exit code, each once; an empty line for a program that was not made. The first end said is the
    one the launcher reads: the program's own, said as it exits, or its parent's as it reaps it (killed, or ended
    before it could say)."""

    def __init__(self, done: int) -> None:
        self.done, self.said, self.pid, self.ended = done, b"", False, False

    def heard(self, chunk: bytes) -> bool:
        """False at the pipe's end."""
        self.said += chunk
        while b"\n" in self.said:
            line, self.said = self.said.split(b"\n", 1)
            kind, _, value = line.partition(b" ")
            if kind == b"pid":
                self.started(value)
            elif kind == b"exit":
                self.exited(value)
        if len(self.said) > 64:  # (no line it would act on: the program's own writes, dropped)
            self.said = b""
        if not chunk and not self.pid:  # (nothing more to say of it)
            os.write(self.done, b"\n")
            self.pid = self.ended = True
        return bool(chunk)

    def started(self, pid: bytes) -> None:
        if not self.pid and pid.isdigit():
            self.pid = True
            os.write(self.done, pid + b"\n")

    def exited(self, code: bytes) -> None:
        if self.ended or not (code.isdigit() and int(code) < 256):
            return
        self.ended = True
        os.write(self.done, (code if self.pid else b"") + b"\n")
        self.pid = True


def program_process(exits: int) -> None:
    """The process forked into a sandbox by its warm template to become the program the launcher hands over on
    WARM_JOB (never returns): in a process group of its own, its pid said on `exits`, it waits for the launcher's
    word, and ends at once when the launcher runs a program of its own (`none`)."""
    try:
        os.setpgid(0, 0)  # (the launcher's deadline stops this group)
        os.write(exits, b"pid %d\n" % os.getpid())
        _keep_exits(exits)
        _wait_for_the_program(())
    except BaseException:  # said where the call will read it
        import traceback

        traceback.print_exc()
        os._exit(125)
    become_program()


_exits: tuple = ()
"""The pipe on which the program's process says its exit code as it exits, what it was (its device and inode),
and the process's pid (a child the program forked says nothing at its own end). The launcher goes on at once,
while the kernel tears down the process's copy of its template's memory (milliseconds for a preloaded heap);
whoever forked the process says its end too, for when it could not: killed, or exec'd."""


def _keep_exits(fd: int) -> None:
    global _exits
    found = os.fstat(fd)
    _exits = (fd, found.st_dev, found.st_ino, os.getpid())


def _say_exit(code: int) -> None:
    """`exit C` on the exits pipe, if the program left it as it was and leaves nothing behind it (else the
    program's end is said as it is reaped: a descriptor the program reused is never written to)."""
    if not _exits or _exits[3] != os.getpid() or not _alone():
        return
    fd, device, inode, _ = _exits
    try:
        found = os.fstat(fd)
        if (found.st_dev, found.st_ino) == (device, inode):
            os.write(fd, b"exit %d\n" % code)
    except OSError:
        pass


def _alone() -> bool:
    """Whether this process has no other thread and no child: only then does nothing of it but itself count
    against the sandbox's process limit as the launcher goes on. Its children, even ended ones, count until its
    sandbox's first process reaps them, after this process is gone; its threads until each has ended."""
    try:
        tasks = os.listdir("/proc/self/task")
        if len(tasks) != 1:
            return False
        with open(f"/proc/self/task/{tasks[0]}/children", "rb") as children:
            return not children.read().strip()
    except OSError:
        return False


def _wait_for_the_program(theirs: tuple) -> None:
    """In the process forked to become the program: ready to, it waits for the launcher's word on WARM_JOB, and
    ends at once on any other word than its folder's."""
    import signal

    os.setpgid(0, 0)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    job = os.open(WARM_JOB, os.O_RDONLY | os.O_CLOEXEC)  # (open for writing already: no wait)
    for fd in theirs:
        os.close(fd)
    _own_streams()
    _fresh_randomness()
    named = _name(b"sandbox-cell")  # (what `ps` and the host say of it while it waits)
    word = b""
    while not word.endswith(b"\n"):
        read = os.read(job, 4096)
        if not read:
            os._exit(0)
        word += read
    os.close(job)
    if word != f"{WARM_DIR}\n".encode():
        os._exit(0)
    _name(named)


def _name(name: bytes) -> bytes:
    """This process's name (its `comm`, not its command line) set to `name`; the name it had. (With prctl: its
    /proc/self/comm is root's, the process not dumpable since it became the sandbox's user.)"""
    had = ctypes.create_string_buffer(16)
    _libc.prctl(PR_GET_NAME, had, 0, 0, 0)
    _libc.prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    return had.value


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 64):
            pass
    except BlockingIOError:
        pass


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def _own_streams() -> None:
    """stdout and stderr as the image's PYTHONUNBUFFERED interpreter has them, on the sandbox's descriptors (the
    template's interpreter started isolated, its streams buffered)."""
    import io

    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
    )
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr


def _fresh_randomness() -> None:
    """Generators seeded when the template imported them are seeded again from the kernel: no two sandboxes of one
    template draw the same numbers."""
    if "random" in sys.modules:
        sys.modules["random"].seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()


def _rehearse() -> None:
    """Draw what a first plotting cell draws, once, before the call: matplotlib's fonts, text layout and PNG
    encoder, and pandas' plotting module (imported at a DataFrame's first plot), are then ready (a first cell
    paid 20 to 30 ms for them)."""
    import io

    import matplotlib.pyplot as plt

    if "pandas" in sys.modules:
        import pandas

        pandas.DataFrame({"a": [1.0, 2.5], "b": [2.0, 0.5]}).plot(title="0,5 · 1")
    else:
        plt.figure().add_subplot().plot([1.0, 2.5], label="a")
        plt.legend()
    plt.gcf().savefig(io.BytesIO(), format="png", dpi=100)
    plt.close("all")


def _program_stdin() -> int:
    """The program's stdin: the request's file, or (handed over in a sandbox forked from a warm template) the bytes
    that follow the request on this process's own stdin, as many as WARM_STDIN says, in a file in memory."""
    try:
        left = int(_read(os.path.basename(WARM_STDIN)))
    except FileNotFoundError:
        return os.open(os.path.join(REQUEST_DIR, "stdin"), os.O_RDONLY)
    held = os.memfd_create("stdin", os.MFD_CLOEXEC)
    while left > 0:
        chunk = os.read(0, min(left, 1 << 20))
        if not chunk:
            break
        written = 0
        while written < len(chunk):
            written += os.write(held, chunk[written:])
        left -= len(chunk)
    os.lseek(held, 0, os.SEEK_SET)
    return held


def _read(name: str) -> bytes:
    with open(os.path.join(WARM_DIR, name), "rb") as handle:
        return handle.read()


def _exported(listing: str) -> dict:
    """The variables of `export -p` output (`export NAME='value'` words; one exported but unset has no `=`)."""
    words = (word for word in shlex.split(listing) if word != "export")
    return dict(word.split("=", 1) for word in words if "=" in word)


def _add_user_site() -> bool:
    """The user site of the call's PYTHONUSERBASE (what `pip install --user` put in the workspace), placed
    as a fresh interpreter places it at start: ahead of the image's packages, its .pth files read.

    This interpreter started (with -s) before the call's workspace was there, so its own start added none.
    False when the user site holds its own version of a library already imported here (say a newer
    pandas): only a fresh interpreter can give the program that one.
    """
    import site

    if "PYTHONUSERBASE" not in os.environ or os.environ.get("PYTHONNOUSERSITE"):
        return True
    site.USER_BASE, site.USER_SITE = os.environ["PYTHONUSERBASE"], None
    folder = site.getusersitepackages()
    if not os.path.isdir(folder) or folder in sys.path:
        return True
    installed = {entry.split(".")[0] for entry in os.listdir(folder) if not entry.endswith((".dist-info", ".pth"))}
    for name in installed & {name.partition(".")[0] for name in sys.modules}:
        if "-packages" in (getattr(sys.modules.get(name), "__file__", None) or ""):
            return False
    before = list(sys.path)
    site.addsitedir(folder)
    added = [entry for entry in sys.path if entry not in before]
    system = next((i for i, entry in enumerate(before) if entry.endswith(("-packages", "/site-python"))), len(before))
    sys.path[:] = before[:system] + added + before[system:]
    return True


def _compiled(script: str) -> str:
    """The image's bytecode of the script when it has it (the image's own launchers, compiled at build), else the
    script itself."""
    compiled = importlib.util.cache_from_source(script)
    return compiled if os.path.exists(compiled) else script


def main() -> None:
    os.setsid()  # the launcher's deadline stops this process group
    early = os.open(WARM_JOB, os.O_RDONLY | os.O_NONBLOCK)  # the launcher's word, seen while importing too

    def called() -> bool:
        return bool(select.select([early], [], [], 0)[0])

    _preload(called)
    if called():
        os.set_blocking(early, True)
        fifo = os.fdopen(early, "rb")
    else:
        os.close(early)
        fifo = open(WARM_JOB, "rb")  # blocks until the launcher hands over its call's program
    with fifo:
        fifo.readline()
    become_program()


def become_program() -> None:
    """Become the program the launcher handed over in WARM_DIR: its argv, environment, folder and stdin, run in
    this interpreter with what it has imported (never returns)."""
    argv = [part.decode() for part in _read("argv").split(b"\0")[:-1]]
    environment = _exported(_read("env").decode("utf-8", "surrogateescape"))
    os.chdir(_read("cwd").decode().rstrip("\n"))
    stdin = _program_stdin()
    os.dup2(stdin, 0)
    os.close(stdin)
    sys.stdin = open(0, encoding="utf-8", errors="surrogateescape", closefd=False)
    os.environ.clear()
    os.environ.update(environment)
    if not _add_user_site():  # the program as a fresh interpreter: same process, stdin, folder and environment
        os.execve(sys.executable, [sys.executable, *argv[1:]], environment)
    script = argv[1]
    sys.argv = argv[1:]
    sys.path[0] = os.path.dirname(script)
    code = 0
    try:
        runpy.run_path(_compiled(script), run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:  # as the interpreter itself reports an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    # What a program's exit does for it (waiting for its non-daemon threads, exit handlers, flushed
    # streams), without tearing down the preloaded modules one by one: with pandas and matplotlib
    # loaded that alone takes ~300 ms.
    if "threading" in sys.modules:
        sys.modules["threading"]._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    code &= 0xFF  # (as the kernel keeps it)
    _say_exit(code)
    os._exit(code)


if __name__ == "__main__":
    main()
