"""The commands' confinement gate (workload/limits.py) on this host, without a cgroup: a command starts behind
`kill -STOP $$; exec "$@"`, is confined from outside while stopped, then continued. Its argv, env, cwd, exit
code and output must be exactly those of a direct exec. (The cgroup itself is proven in a real guest:
tests/vm/test_workload_vm.py, the fork bomb.)"""

from __future__ import annotations

import os
import pwd
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.protocol.envd_process import EndEvent, ProcessConfig, StartRequest
from cubeaccel.workload import limits
from cubeaccel.workload.connect import ConnectError
from cubeaccel.workload.process import ProcessTable
from cubeaccel.workload.users import User


def _me() -> User:
    e = pwd.getpwuid(os.geteuid())
    return User(e.pw_name, e.pw_uid, e.pw_gid, e.pw_dir)


def _run(table: ProcessTable, cmd: str, *args: str, cwd: str | None = None) -> tuple[bytes, EndEvent]:
    proc = ProcessConfig(cmd, args, {"ONE": "1"}, cwd)
    _, sub = table.start(StartRequest(proc, stdin=False), _me(), 30)
    out = b""
    while True:
        item = sub.get(30)
        assert item is not None
        if isinstance(item, EndEvent):
            return out, item
        out += item.data


def test_a_gated_command_runs_exactly_as_a_direct_one(tmp_path: Path) -> None:
    gated = ProcessTable(limits=limits.CommandLimits(procs=None, shell="/bin/bash"))  # the guest's: busybox ash
    plain = ProcessTable()
    script = 'printf "%s|" "$0" "$1" "$ONE" "$(pwd)"; echo; exit 3'
    for table in (gated, plain):
        out, end = _run(table, "/bin/sh", "-c", script, "a b", "c", cwd=str(tmp_path))
        assert out == f"a b|c|1|{tmp_path}|\n".encode()
        assert end.exit_code == 3
    out, end = _run(gated, "true")  # found on PATH, as exec "$@" finds it
    assert out == b"" and end.exit_code == 0
    out, _ = _run(gated, "sh", "-c", 'echo "$0"')  # argv[0] as given, though the gate execs the absolute path
    assert out == b"sh\n"
    with pytest.raises(ConnectError) as err:
        _run(gated, "/no/such/binary")
    assert err.value.code == "invalid_argument"


def test_confine_writes_the_pid_into_the_groups_procs_file_while_the_command_is_stopped(tmp_path: Path) -> None:
    procs = tmp_path / "cgroup.procs"
    procs.write_text("")
    table = ProcessTable(limits=limits.CommandLimits(procs=str(procs), shell="/bin/bash"))
    out, end = _run(table, "/bin/sh", "-c", "echo $$")
    assert end.exit_code == 0
    assert procs.read_text() == out.decode().strip()  # the command's own pid (sh exec'd it: same pid)


def test_a_command_is_always_within_the_oom_killers_reach_though_the_service_is_not(tmp_path: Path) -> None:
    """The guest init starts the services with oom_score_adj -1000, which every child inherits: each command gets
    envd's +100 before it runs, with or without a cgroup (a guest without cgroup v2 too)."""
    for procs in (None, str(tmp_path / "cgroup.procs")):
        table = ProcessTable(limits=limits.CommandLimits(procs=procs, shell="/bin/bash"))
        out, end = _run(table, "/bin/cat", "/proc/self/oom_score_adj")
        assert end.exit_code == 0 and out.decode().strip() == str(limits.COMMAND_OOM_SCORE_ADJ), procs


def test_setup_configures_a_cgroup_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("setup() only acts as root")
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    group = tmp_path / limits.GROUP_NAME
    group.mkdir()
    for f in ("pids.max", "memory.max", "cpu.weight"):
        (group / f).write_text("max\n")
    monkeypatch.setattr(Path, "write_text", _recording_write_text(monkeypatch), raising=True)
    got = limits.setup(300, root=tmp_path)
    assert got.procs == str(group / "cgroup.procs")
    assert (group / "pids.max").read_text() == "300"
    assert int((group / "memory.max").read_text()) >= limits.MEMORY_FLOOR_MIB * 1024 * 1024
    assert (group / "cpu.weight").read_text() == str(limits.COMMAND_CPU_WEIGHT)
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+pids +memory +cpu"


def _recording_write_text(monkeypatch: pytest.MonkeyPatch) -> Any:
    real = Path.write_text

    def write_text(self: Path, data: str, *a: Any, **kw: Any) -> int:
        if str(self) == "/proc/self/oom_score_adj":
            return len(data)  # not this test process's
        return real(self, data, *a, **kw)

    return write_text
