"""The runc path's config says what the engine's HostConfig says, field by field: no hardening is dropped on the
way from one to the other."""

from __future__ import annotations

import json

from sandbox_server.policy.loader import load_policy
from sandbox_server.sandbox.engine.host_config import MASKED_PATHS, host_config_kwargs
from sandbox_server.sandbox.runc.oci import INIT_PATH, NATIVE, oci_config, oci_seccomp
from sandbox_server.sandbox.spec import Mount, ResourceLimits, SandboxSpec
from sandbox_server.tools import all_tools


def _spec(**more: object) -> SandboxSpec:
    tool = load_policy("default", [t.name for t in all_tools()]).for_tool("execute_command")
    limits = ResourceLimits(memory_mb=300, cpus=1.5, pids=77, nofile=333, file_size_mb=9, tmp_mb=11, workspace_mb=13)
    return SandboxSpec(
        image="i", argv=("true",), limits=limits, user="1000:1000", seccomp_profile=tool.seccomp_profile,
        **more,  # type: ignore[arg-type]
    )  # fmt: skip


def test_limits_mounts_and_privileges_match_the_engines_host_config() -> None:
    spec = _spec(mounts=(Mount("/srv/data", "/data"),))
    engine, oci = host_config_kwargs(spec), oci_config(spec, "/rootfs", ["sh"])
    resources = oci["linux"]["resources"]
    assert resources["memory"] == {"limit": engine["mem_limit"], "swap": engine["memswap_limit"]}
    assert resources["pids"]["limit"] == engine["pids_limit"]
    assert resources["cpu"]["quota"] / resources["cpu"]["period"] == engine["nano_cpus"] / 1e9
    limits = {item["type"]: item["hard"] for item in oci["process"]["rlimits"]}
    assert limits == {
        "RLIMIT_NOFILE": 333, "RLIMIT_FSIZE": 9 * 1024 * 1024, "RLIMIT_CORE": 0
    } == {f"RLIMIT_{u['name'].upper()}": u["hard"] for u in engine["ulimits"]}  # fmt: skip
    tmpfs = {m["destination"]: ",".join(m["options"]) for m in oci["mounts"] if m["type"] == "tmpfs"}
    assert tmpfs["/tmp"] == engine["tmpfs"]["/tmp"] and tmpfs["/workspace"] == engine["tmpfs"]["/workspace"]
    assert oci["root"]["readonly"] is engine["read_only"] is True
    assert oci["process"]["noNewPrivileges"] and "no-new-privileges" in engine["security_opt"]
    assert all(granted == [] for granted in oci["process"]["capabilities"].values()) and engine["cap_drop"] == ["ALL"]
    assert oci["linux"]["maskedPaths"] == list(MASKED_PATHS)
    assert oci["process"]["args"][:2] == [INIT_PATH, "--"] and engine["init"] is True
    [data] = [m for m in oci["mounts"] if m["destination"] == "/data"]
    assert data["source"] == "/srv/data" and "ro" in data["options"] and engine["binds"]["/srv/data"]["mode"] == "ro"
    assert {"type": "network"} in oci["linux"]["namespaces"] and engine["network_mode"] == "none"
    assert oci["hostname"] == "sandbox"


def test_a_kept_workspace_slot_is_bound_as_the_engine_binds_it() -> None:
    spec = _spec()
    oci = oci_config(spec, "/rootfs", ["sh"], slot="/run/slot-1")
    [workspace] = [m for m in oci["mounts"] if m["destination"] == spec.workdir]
    assert workspace == {
        "destination": spec.workdir,
        "type": "bind",
        "source": "/run/slot-1",
        "options": ["rbind", "rslave"],
    }
    [engine] = host_config_kwargs(spec, "/run/slot-1")["mounts"]
    assert engine["Source"] == "/run/slot-1" and engine["BindOptions"]["Propagation"] == "rslave"


def test_the_engines_seccomp_format_becomes_the_runtime_specs() -> None:
    profile = {
        "defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 1,
        "archMap": [{"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86"]}],
        "syscalls": [
            {"names": ["read"], "action": "SCMP_ACT_ALLOW"},
            {"names": ["ptrace"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_PTRACE"]}},
            {"names": ["personality"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": 0, "op": "SCMP_CMP_EQ"}]},
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38, "excludes": {"caps": ["CAP_SYS_ADMIN"]}},
        ],
    }  # fmt: skip
    said = oci_seccomp(json.dumps(profile))
    # The host's own ABI alone, when the profile lists it (a 32-bit call is then refused outright).
    listed = ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86"]
    assert said["architectures"] == ([NATIVE] if NATIVE in listed else listed) and said["defaultErrnoRet"] == 1
    assert [rule["names"] for rule in said["syscalls"]] == [["read"], ["personality"], ["clone3"]]  # no capability
    assert said["syscalls"][2]["errnoRet"] == 38 and said["syscalls"][1]["args"][0]["op"] == "SCMP_CMP_EQ"
    shipped = _spec().seccomp_profile
    assert shipped is not None
    allowed = {name for r in oci_seccomp(shipped)["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" for name in r["names"]}
    assert "read" in allowed and "io_uring_setup" not in allowed  # the shipped profile's point, kept
