"""`cubeaccel up` signals only the processes it started (issue 30 #9): a pid from a stale `up.json` is checked
against the start time recorded with it, never against a command line that anyone's process may have."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cubeaccel.host.pci.procfs import start_time
from cubeaccel.master import up
from tests.support.poll import poll


@pytest.fixture
def someone_elses() -> Iterator[subprocess.Popen[bytes]]:
    """A process that now has a pid an old `up.json` lists, and "cubeaccel" in its command line."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "not-cubeaccel-at-all"])
    yield p
    p.kill()
    p.wait()


def test_a_reused_pid_from_a_stale_up_json_is_not_signalled(
    someone_elses: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    start = start_time(someone_elses.pid)
    assert start is not None
    for info in (
        {"pids": [someone_elses.pid]},  # written before start times were recorded: nothing verifiable
        {"pids": [someone_elses.pid], "starts": [start - 1]},  # the pid's earlier owner
    ):
        (tmp_path / "up.json").write_text(json.dumps(info))
        assert up.running(tmp_path) is None
        up._stop(up._listed(json.loads((tmp_path / "up.json").read_text())))
        assert someone_elses.poll() is None, f"{info}: someone else's process was killed"


def test_the_process_up_started_is_still_stopped(someone_elses: subprocess.Popen[bytes]) -> None:
    up._stop(up._listed({"pids": [someone_elses.pid], "starts": [start_time(someone_elses.pid)]}))
    poll(lambda: someone_elses.poll() is not None, 10.0)
