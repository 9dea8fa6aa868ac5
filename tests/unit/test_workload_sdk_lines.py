"""envd features through the real e2b SDK at each line in docs/e2b.md's matrix (2.15.2, 2.45.1, the pinned one),
against the real workload service (no VM): command deadlines, directory watch, entry info, file metadata."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cubeaccel.workload import ENVD_VERSION
from tests.support.e2b_sdk import sdk_path
from tests.workload_client import ROOT

LINES = ("2.15.2", "2.45.1", "2.63.0")  # 2.63.0: the pinned dev dependency, importable here
CHECK = ROOT / "tests" / "e2b" / "sdk_envd_check.py"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("sdk-lines")
    token = "lines-" + os.urandom(8).hex()
    (tmp / "token").write_text(token)
    token_file = str(tmp / "token")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = tmp / "stderr"
    server = subprocess.Popen(
        [sys.executable, "-m", "cubeaccel.workload", "serve", "--tcp", f"127.0.0.1:{port}", "--token-file", token_file],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        stderr=err.open("wb"),
    )
    try:
        deadline = time.monotonic() + 30
        while b"serving on" not in err.read_bytes():
            assert server.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}", token
    finally:
        server.terminate()
        server.wait(10)


def run_line(version: str, url: str, token: str, scratch: Path, *checks: str) -> dict[str, object]:
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
    if version != LINES[-1]:
        env["PYTHONPATH"] = str(sdk_path(version))
    r = subprocess.run(
        [sys.executable, "-s", str(CHECK), url, token, ENVD_VERSION, str(scratch), *checks],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    seen: dict[str, object] = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["version"] == version
    return seen


@pytest.mark.parametrize("version", LINES)
def test_a_command_past_its_timeout_is_the_sdks_timeout_error(
    service: tuple[str, str], tmp_path: Path, version: str
) -> None:
    seen = run_line(version, *service, tmp_path, "deadline")
    assert seen["passed"] == ["deadline"]


@pytest.mark.parametrize("version", LINES)
def test_directory_watch_in_the_polling_form(service: tuple[str, str], tmp_path: Path, version: str) -> None:
    seen = run_line(version, *service, tmp_path, "watch")
    assert seen["passed"] == ["watch"]


@pytest.mark.parametrize("version", LINES)
def test_directory_watch_in_the_stream_form(service: tuple[str, str], tmp_path: Path, version: str) -> None:
    """The async SDK's `watch_dir` (`WatchDir` stream): it read an empty message while the guest wrapped each
    one in an `event` key that envd's WatchDirResponse does not have."""
    seen = run_line(version, *service, tmp_path, "stream_watch")
    assert seen["passed"] == ["stream_watch"]


@pytest.mark.parametrize("version", LINES)
def test_entry_info_and_file_metadata(service: tuple[str, str], tmp_path: Path, version: str) -> None:
    seen = run_line(version, *service, tmp_path, "info", "metadata")
    assert seen["passed"] == (["info"] if version == "2.15.2" else ["info", "metadata"]), seen


def test_the_front_door_reports_the_envd_version_the_guest_implements() -> None:
    from cubeaccel.frontdoor.mapping import ENVD_VERSION as REPORTED

    assert REPORTED == ENVD_VERSION
