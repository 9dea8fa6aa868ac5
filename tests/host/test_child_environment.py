"""Issue 30 #6: a secret exported where the Cubelet runs reaches none of the processes it starts — the spawned
shim, the shim fork server, a forked shim — and a VMM gets nothing of its parent's environment at all. Real
processes, held alive at a known step by the report socket (tests/host/test_shim_forkserver.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cubeaccel
from cubeaccel.cubelet.process_shim import ProcessShimDriver
from cubeaccel.host.service import childenv
from cubeaccel.host.vmm.vmmproc import find_shim
from cubeaccel.transport.telemetry import LOG_LEVEL_ENV
from cubeaccel.wire.shim_launch import SOCKET_NAME
from cubeaccel.wire.shim_spec import ShimSpec
from tests.host.test_shim_forkserver import HeldReports, refused_spec
from tests.support.poll import poll

SECRETS = {"CUBEACCEL_API_KEY": "cbk_dead_beefsecret", "AWS_SECRET_ACCESS_KEY": "aws-secret-123"}


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


def test_a_secret_exported_for_the_cubelet_reaches_no_shim_nor_the_fork_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(LOG_LEVEL_ENV, "WARNING")  # a setting: it must still reach them
    driver = ProcessShimDriver(tmp_path / "state")
    held = HeldReports(driver.socket)
    try:
        driver.start(ShimSpec.model_validate(refused_spec("first", tmp_path / "reports.sock")))
        spawned = poll(lambda: find_shim("first", under=driver.dir), 30)
        poll(lambda: (driver.dir / SOCKET_NAME).exists(), 60, what="fork server listening")
        driver.start(ShimSpec.model_validate(refused_spec("second", tmp_path / "reports.sock")))
        forked = poll(lambda: find_shim("second", under=driver.dir), 30)
        assert driver.forks is not None and driver.forks.pid is not None
        for what, pid in (("spawned shim", spawned), ("fork server", driver.forks.pid), ("forked shim", forked)):
            env = environ(pid)
            leaked = {k for k, v in SECRETS.items() if k in env or any(v in x for x in env.values())}
            assert not leaked, f"{what} inherited {leaked}"
            assert env.get(LOG_LEVEL_ENV) == "WARNING", what
        held.release.set()
        poll(lambda: find_shim("first", under=driver.dir) is None and find_shim("second", under=driver.dir) is None, 30)
    finally:
        held.close()
        driver.close()


def test_a_vmm_gets_only_its_tags_and_a_fixed_path(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PATH", "/home/op/bin:/usr/bin")
    env = childenv.vmm_env({"CUBEACCEL_SANDBOX": "sb-1"})
    assert env == {"PATH": childenv.SAFE_PATH, "CUBEACCEL_SANDBOX": "sb-1"}
    tool = childenv.component_env(passed=())  # nft, ip, mkfs
    assert not set(SECRETS) & set(tool) and tool["PATH"] == "/home/op/bin:/usr/bin"


def test_a_component_runs_the_code_its_parent_runs(tmp_path: Path) -> None:
    """A stack started from a copy of the code (a worktree, a checkout beside an editable install of another
    tree): the processes it starts import that copy, not what the interpreter would find by default."""
    copy = tmp_path / "tree"
    shutil.copytree(Path(cubeaccel.__file__).parent, copy / "cubeaccel", ignore=shutil.ignore_patterns("__pycache__"))
    parent = (
        "import subprocess, sys\n"
        "from cubeaccel.host.service.childenv import component_env\n"
        "child = 'import cubeaccel; print(cubeaccel.__file__)'\n"
        "print(subprocess.run([sys.executable, '-c', child], env=component_env(), capture_output=True, text=True,"
        " check=True, timeout=60).stdout, end='')\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", parent],
        env={"PYTHONPATH": str(copy), "PATH": childenv.SAFE_PATH},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    assert Path(ran.stdout.strip()) == copy / "cubeaccel" / "__init__.py"


def test_a_host_tool_gets_no_python_search_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    assert "PYTHONPATH" not in childenv.tool_env()
    assert childenv.component_env()["PYTHONPATH"] == childenv.CODE_ROOT
