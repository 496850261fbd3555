"""Images people bring, and the toolchain image, in one run:

- a team's image from a one-line Dockerfile on top of `shell` (a fresh line each round, so nothing is cached),
  built by the server (the build, then the needs looked for and the sandbox's files committed) against `docker
  build` of the same kind of context through the engine's API; the unpacking for runc that `images build --policy` adds is timed apart;
- `execute_command true` spaced 0.3 s apart on a server whose policy runs it in that image, against one on the
  default policy (`shell`);
- C, Go, Rust and Java hello-worlds compiled and run in one call each on the `toolchain` policy, six times in
  one kept workspace, calls 0.5 s apart (the first call, then the median of the later ones), against the same
  command run on the host with no sandbox (the image's own compilers under chroot, its workspace a folder on the
  host's disk), six times 0.5 s apart too.

    scripts/run bench images [--rounds 3]

Prints tables and writes bench/results/images.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import docker
from mcp import Client

from bench.common import UNCAPPED, median, print_table, write_results
from bench.measure import percentiles, timed_calls
from sandbox_server.cli.client import server_parameters
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.engine.team_images import TeamImage, build_team_image, team_image_reference
from sandbox_server.sandbox.runc.bundles import unpacked
from sandbox_server.sandbox.runc.runtime import unpack_for_runc
from sandbox_server.sandbox.runc.state import IMAGES

TOOLCHAIN = "sandbox-server/toolchain:latest"
RUNS = 6
"""Each toolchain command's runs, through the server and on the host: the first, then those with its caches made."""
HOST_MOUNTS = 'mount --bind "$1" "$2/workspace" && mount --rbind /proc "$2/proc" && mount --rbind /dev "$2/dev"'
"""The workspace folder, then the host's /proc and /dev, in the unpacked image (in a mount namespace of its own)."""
LANGUAGES = {
    "C": ("hello.c", '#include <stdio.h>\nint main(void) { printf("hello\\n"); return 0; }\n',
          "gcc -O2 -o hello hello.c && ./hello"),
    "Go": ("hello.go", 'package main\nimport "fmt"\nfunc main() { fmt.Println("hello") }\n',
           "go build -o hello-go hello.go && ./hello-go"),
    "Rust": ("hello.rs", 'fn main() { println!("hello"); }\n', "rustc -O hello.rs -o hello-rs && ./hello-rs"),
    "Java": ("Hello.java", 'public class Hello { public static void main(String[] a) { System.out.println("hello"); } }\n',
             "javac Hello.java && java Hello"),
}  # fmt: skip


def _context(folder: Path, name: str) -> Path:
    """A one-line Dockerfile on top of shell, of its own (a fresh line: nothing cached)."""
    context = folder / name
    context.mkdir()
    (context / "Dockerfile").write_text(
        f"FROM sandbox-server/shell:latest\nRUN echo {uuid.uuid4().hex} > /tmp/team-marker\n"
    )
    return context


def _builds(runtime: DockerRuntime, folder: Path, round_number: int) -> tuple[dict[str, float], str]:
    """One round: the engine's own build, then the server's, of contexts alike; the server's image reference."""
    plain = _context(folder, f"plain-{round_number}")
    started = time.perf_counter()
    for _ in runtime.build(str(plain), f"sandbox-server/bench-plain-{round_number}:latest", {}, {}):
        pass
    docker_s = time.perf_counter() - started
    runtime.untag(f"sandbox-server/bench-plain-{round_number}:latest")
    context = _context(folder, f"team-{round_number}")
    team = TeamImage(team_image_reference(context), context, ("execute_command",))
    started = time.perf_counter()
    build_team_image(runtime, team, say=lambda _: None)
    ours_s = time.perf_counter() - started
    started = time.perf_counter()
    unpack_for_runc(runtime, [team.reference], say=lambda _: None)
    unpack_s = time.perf_counter() - started
    times = {"docker_build_s": round(docker_s, 2), "server_build_s": round(ours_s, 2), "unpack_s": round(unpack_s, 2)}
    return times, team.reference


async def _pools_filled(client: Client) -> None:
    """A new server's first calls, spaced so that its pools are filled before anything is timed."""
    for _ in range(3):
        await client.call_tool("execute_command", {"command": "true"})
        await anyio.sleep(1)


async def _true_p50(policy: Path) -> float:
    async with Client(server_parameters(["--policy", str(policy)]), mode="legacy") as client:
        await _pools_filled(client)
        samples, failures = await timed_calls(client, "execute_command", {"command": "true"}, 30, 0.3)
        assert failures == 0
    return percentiles(samples)["p50"]


async def _toolchain_calls() -> dict[str, dict[str, float]]:
    """Each language's command six times in one kept workspace through the server, once the server's pools are
    filled: seconds of the first call, and the median of the later ones (the workspace's caches made)."""
    found: dict[str, dict[str, float]] = {}
    async with Client(server_parameters(["--policy", "toolchain"]), mode="legacy") as client:
        await _pools_filled(client)
        for language, (path, source, command) in LANGUAGES.items():
            times = []
            for _ in range(RUNS):
                files = [{"path": path, "content": source}]
                started = time.perf_counter()
                result = await client.call_tool("execute_command", {"command": command, "files": files})
                times.append(time.perf_counter() - started)
                await anyio.sleep(0.5)  # as an agent reads an answer: the pool makes the next sandbox meanwhile
                assert not result.is_error and result.structured_content is not None
                assert result.structured_content["stdout"] == "hello\n", result.structured_content
            found[language] = {"first_s": round(times[0], 3), "second_s": round(median(times[1:]), 3)}
    return found


def _on_the_host(api: docker.APIClient) -> dict[str, float]:
    """Each language's command run on the host itself, with no sandbox: the toolchain image's own compilers (its
    files unpacked, as runc's sandboxes use them) under chroot as the sandbox's user, its workspace a folder on the
    host's disk (HOST_MOUNTS), run RUNS times 0.5 s apart as the calls are; seconds, the median of the runs after
    the first (its caches made)."""
    root = unpacked(api, TOOLCHAIN, api.inspect_image(TOOLCHAIN), IMAGES)
    script = "cd /workspace && " + " && ".join(
        f"printf %s {_quoted(source)} > {path} && for i in $(seq {RUNS}); do s=$(date +%s%N) && {command} >/dev/null"
        f" && echo {language} $(( ($(date +%s%N) - s) / 1000 )) && sleep 0.5; done"
        for language, (path, source, command) in LANGUAGES.items()
    )
    folder = Path(tempfile.mkdtemp(prefix="bench-toolchain-"))  # on the host's disk, as a kept workspace is
    os.chown(folder, 1000, 1000)
    inside = ["env", "-i", "HOME=/workspace", "PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8", "/bin/sh", "-c"]
    try:
        done = subprocess.run(
            ["unshare", "--mount", "sh", "-c", f'{HOST_MOUNTS} && shift 2 && exec "$@"', "sh", str(folder), str(root),
             "chroot", "--userspec=1000:1000", str(root), *inside, script],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    runs: dict[str, list[float]] = {}
    for line in done.stdout.split("\n"):
        if line.strip():
            runs.setdefault(line.split()[0], []).append(int(line.split()[1]) / 1e6)
    return {language: round(median(times[1:]), 3) for language, times in runs.items()}


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench images", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args(argv)
    runtime = DockerRuntime.connect()
    builds: list[dict[str, float]] = []
    true_runs: dict[str, list[float]] = {"shell": [], "team": []}
    toolchain: list[dict[str, dict[str, float]]] = []
    host: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as work:
        folder = Path(work)
        made: list[str] = []
        try:
            for number in range(options.rounds):
                times, reference = _builds(runtime, folder, number)
                builds.append(times)
                made.append(reference)
            default, team = folder / "default.yaml", folder / "team.yaml"
            default.write_text(UNCAPPED)
            team.write_text(UNCAPPED + f"tools:\n  execute_command:\n    build: {folder / 'team-0'}\n")
            for _ in range(options.rounds):
                true_runs["shell"].append(anyio.run(_true_p50, default))
                true_runs["team"].append(anyio.run(_true_p50, team))
                toolchain.append(anyio.run(_toolchain_calls))
                host.append(_on_the_host(runtime.api))
        finally:
            for reference in made:
                runtime.untag(reference)
    summary: dict[str, Any] = {
        "docker_build_s": median([b["docker_build_s"] for b in builds]),
        "server_build_s": median([b["server_build_s"] for b in builds]),
        "unpack_for_runc_s": median([b["unpack_s"] for b in builds]),
        "true_p50_ms": {name: median(values) for name, values in true_runs.items()},
        "toolchain": {
            language: {
                "first_call_s": median([run[language]["first_s"] for run in toolchain]),
                "second_call_s": median([run[language]["second_s"] for run in toolchain]),
                "on_the_host_s": median([run[language] for run in host]),
            }
            for language in LANGUAGES
        },
    }
    summary["server_build_over_docker"] = round(summary["server_build_s"] / summary["docker_build_s"], 2)
    summary["team_true_over_shell"] = round(summary["true_p50_ms"]["team"] / summary["true_p50_ms"]["shell"], 2)
    for row in summary["toolchain"].values():
        row["second_over_host"] = round(row["second_call_s"] / row["on_the_host_s"], 2)
    print_table(
        ["measure", "value"],
        [
            ["docker build (s)", summary["docker_build_s"]],
            ["server's build of a team image (s)", summary["server_build_s"]],
            ["  over docker build", summary["server_build_over_docker"]],
            ["unpacking it for runc (s)", summary["unpack_for_runc_s"]],
            ["true p50, shell (ms)", summary["true_p50_ms"]["shell"]],
            ["true p50, team image (ms)", summary["true_p50_ms"]["team"]],
            ["  team over shell", summary["team_true_over_shell"]],
        ],
    )
    print_table(
        ["language", "first call (s)", "second call (s)", "on the host (s)", "second over host"],
        [[lang, *row.values()] for lang, row in summary["toolchain"].items()],
    )
    written = write_results(
        "images",
        {"summary": summary, "runs": {"builds": builds, "true": true_runs, "toolchain": toolchain, "host": host}},
    )
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
