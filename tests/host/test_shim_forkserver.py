"""The shim fork server (issue 18, deliverable 6), with real processes: Cubelet's driver, the fork server, the
forked shim. A forked shim must be indistinguishable from a spawned one to everything that looks for it.

The shim under test runs the real `run` path with a spec it refuses at once (`hotplug: false`) and reports that
over HTTP to a unix socket this test holds: until the test answers, the shim is alive at a known step, so its
argv, environment, working directory and log can be checked without racing its exit.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.cubelet.process_shim import ProcessShimDriver
from cubeaccel.cubelet.shim_forkserver import ForkServer
from cubeaccel.host.service import proctitle
from cubeaccel.host.vmm.vmmproc import find_shim
from cubeaccel.transport.telemetry import LOG_LEVEL_ENV
from cubeaccel.wire.shim_launch import SOCKET_NAME
from cubeaccel.wire.shim_spec import ShimSpec
from tests.support.poll import poll


class HeldReports:
    """An HTTP endpoint on a unix socket that hands each request's JSON body to the test and answers only
    when the test says so."""

    def __init__(self, path: Path) -> None:
        self.bodies: queue.Queue[dict[str, Any]] = queue.Queue()
        self.release = threading.Event()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                while len(body) < length:
                    body += conn.recv(65536)
                self.bodies.put(json.loads(body))
                self.release.wait(30)
                conn.sendall(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    def close(self) -> None:
        self.release.set()
        self.sock.close()


def refused_spec(sid: str, reports: Path) -> dict[str, object]:
    """Refused by the shim's first check, reported to `reports` (the driver puts in its own socket and dir)."""
    run_dir = reports.parent / "runs" / sid
    return {
        "sandbox_id": sid,
        "memory_mib": 256,
        "hotplug": False,  # with a device to plug: refused (a CPU-only spec plugs nothing and would go on)
        "devices": [
            {
                "device_id": "emulated-0000:e0:00.0",
                "driver": "edu",
                "properties": {},
                "vendor_id": "1234",
                "device_id_hex": "11e8",
            }
        ],
        "report": {"socket": str(reports)},
        "state_dir": str(run_dir),
    }


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
    except OSError:
        return True


@pytest.fixture
def held(tmp_path: Path):  # type: ignore[no-untyped-def]
    server = HeldReports(tmp_path / "reports.sock")
    yield server
    server.close()


def started_fork_server(shims: Path) -> ForkServer:
    forks = ForkServer(shims, sys.executable)
    forks.ensure_started()
    poll(lambda: (shims / SOCKET_NAME).exists() and forks.pid is not None, 60, what="fork server listening")
    return forks


def test_a_forked_shim_shows_the_spawned_argv_and_runs_with_the_callers_env_cwd_and_log(
    tmp_path: Path, held: HeldReports, monkeypatch: pytest.MonkeyPatch
) -> None:
    shims = tmp_path / "shims"
    shims.mkdir()
    forks = started_fork_server(shims)
    try:
        sid = f"fork-{os.getpid()}"
        spec = shims / f"{sid}.json"
        spec.write_text(json.dumps(refused_spec(sid, tmp_path / "reports.sock")))
        monkeypatch.setenv(LOG_LEVEL_ENV, "WARNING")  # set after the fork server started: it must still apply
        monkeypatch.chdir(tmp_path)
        argv = [sys.executable, "-m", "cubeaccel.shim", "run", "--sandbox", sid, "--spec", str(spec)]
        with open(tmp_path / "shim.log", "ab") as log:
            pid = forks.launch(argv, log.fileno(), None)
        assert pid is not None, forks.last_refusal
        report = held.bodies.get(timeout=30)  # the shim is now blocked on this report's answer
        assert report["kind"] == "attach_failed" and report["details"]["reason"] == "shim.coldplug_unsupported"
        assert find_shim(sid, under=shims) == pid  # found exactly as a spawned shim is
        shown = [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0") if a]
        assert shown == argv
        assert os.readlink(f"/proc/{pid}/cwd") == str(tmp_path)
        assert os.readlink(f"/proc/{pid}/fd/2") == str(tmp_path / "shim.log")
        ppid = int(Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[1])
        assert ppid == forks.pid and os.getsid(pid) == pid  # the server's child, in a session of its own
        held.release.set()
        poll(lambda: gone(pid), 30, what="forked shim exited and reaped by its server")
        assert find_shim(sid, under=shims) is None
        logged = (tmp_path / "shim.log").read_text()
        assert '"msg":"report"' not in logged  # INFO lines, which the fork server's own environment would allow
    finally:
        forks.close()


def test_the_fork_server_refuses_bad_requests_and_still_serves_the_next(tmp_path: Path, held: HeldReports) -> None:
    shims = tmp_path / "shims"
    shims.mkdir()
    forks = started_fork_server(shims)
    try:
        not_a_shim = b'{"argv": ["python", "-c", "print(1)"], "env": {}, "cwd": "/"}'
        for body in (b"{not json", not_a_shim):
            with socket.socket(socket.AF_UNIX) as s, open(tmp_path / "x.log", "ab") as log:
                s.connect(str(shims / SOCKET_NAME))
                socket.send_fds(s, [body], [log.fileno()])
                s.shutdown(socket.SHUT_WR)
                reply = json.loads(s.recv(65536))
            assert reply["pid"] is None and reply["error"].startswith("bad request")
        with socket.socket(socket.AF_UNIX) as s:  # a request without its log descriptor
            s.connect(str(shims / SOCKET_NAME))
            s.sendall(b"{}")
            s.shutdown(socket.SHUT_WR)
            assert "no log descriptor" in json.loads(s.recv(65536))["error"]
        sid = f"after-{os.getpid()}"
        (shims / f"{sid}.json").write_text(json.dumps(refused_spec(sid, tmp_path / "reports.sock")))
        argv = [sys.executable, "-m", "cubeaccel.shim", "run", "--sandbox", sid, "--spec", str(shims / f"{sid}.json")]
        with open(tmp_path / "shim.log", "ab") as log:
            assert forks.launch(argv, log.fileno(), None) is not None, forks.last_refusal
        held.release.set()
    finally:
        forks.close()


def test_the_fork_server_goes_with_its_cubelet_and_its_shims_stay(tmp_path: Path, held: HeldReports) -> None:
    shims = tmp_path / "shims"
    shims.mkdir()
    forks = started_fork_server(shims)
    server_pid = forks.pid
    assert server_pid is not None
    sid = f"stays-{os.getpid()}"
    (shims / f"{sid}.json").write_text(json.dumps(refused_spec(sid, tmp_path / "reports.sock")))
    argv = [sys.executable, "-m", "cubeaccel.shim", "run", "--sandbox", sid, "--spec", str(shims / f"{sid}.json")]
    with open(tmp_path / "shim.log", "ab") as log:
        pid = forks.launch(argv, log.fileno(), None)
    assert pid is not None
    held.bodies.get(timeout=30)
    forks.close()  # Cubelet's end of the pipe closes, as when Cubelet exits
    assert gone(server_pid)
    assert find_shim(sid, under=shims) == pid  # the sandbox's shim does not go with it
    assert forks.launch(argv, 0, None) is None and forks.last_refusal == "not running"
    held.release.set()
    poll(lambda: find_shim(sid, under=shims) is None, 30, what="the shim finished on its own")


def test_the_driver_spawns_the_first_shim_and_forks_the_next(tmp_path: Path) -> None:
    driver = ProcessShimDriver(tmp_path / "state")
    held = HeldReports(driver.socket)  # where the driver's shims report: Cubelet's socket
    try:
        driver.start(ShimSpec.model_validate(refused_spec("first", tmp_path / "reports.sock")))
        first = poll(lambda: find_shim("first", under=driver.dir), 30)
        assert driver.forks is not None and driver.forks.last_refusal is not None  # none was running yet
        assert driver._children["first"].pid == first  # spawned by the driver itself
        assert driver.launches == {"fork": 0, "spawn": 1}
        poll(lambda: (driver.dir / SOCKET_NAME).exists(), 60, what="fork server listening")
        driver.start(ShimSpec.model_validate(refused_spec("second", tmp_path / "reports.sock")))
        second = find_shim("second", under=driver.dir)
        assert second is not None and "second" not in driver._children
        assert int(Path(f"/proc/{second}/stat").read_text().split(") ")[1].split()[1]) == driver.forks.pid
        assert driver.launches == {"fork": 1, "spawn": 1}  # what `cubeaccel_shim_launches_total` serves
        held.release.set()
        poll(lambda: find_shim("first", under=driver.dir) is None and find_shim("second", under=driver.dir) is None, 30)
    finally:
        held.close()
        driver.close()


def test_spawn_mode_never_starts_a_fork_server(tmp_path: Path) -> None:
    driver = ProcessShimDriver(tmp_path / "state", launch="spawn")
    held = HeldReports(driver.socket)
    driver.start(ShimSpec.model_validate(refused_spec("only", tmp_path / "reports.sock")))
    assert driver.forks is None and "only" in driver._children
    assert held.bodies.get(timeout=30)["kind"] == "attach_failed"
    held.close()
    driver._children["only"].wait(30)
    assert not (driver.dir / SOCKET_NAME).exists()
    with pytest.raises(ValueError, match="shim launch"):
        ProcessShimDriver(tmp_path / "other", launch="thread")


def test_a_cmdline_is_rewritten_in_place_and_never_past_its_room(tmp_path: Path) -> None:
    sid = f"renamed-{uuid.uuid4().hex[:12]}"  # unique to this run: find_shim reads the whole host's /proc
    code = (
        "import sys; from cubeaccel.host.service import proctitle as p\n"
        "try:\n    p.set_cmdline(['x' * 9000])\nexcept ValueError as e:\n    print('refused', e, flush=True)\n"
        f"p.set_cmdline(['python', 'shim', 'run', '--sandbox', '{sid}'])\nprint('done', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, *proctitle.room_args(256)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().startswith("refused argv needs 9001 bytes")
        assert child.stdout.readline() == "done\n"
        assert find_shim(sid) == child.pid
        assert [a for a in Path(f"/proc/{child.pid}/cmdline").read_bytes().split(b"\0") if a] == [
            b"python",
            b"shim",
            b"run",
            b"--sandbox",
            sid.encode(),
        ]
    finally:
        child.kill()
        child.wait()
    with pytest.raises(ValueError):
        proctitle.encode(["ok", "bad\0arg"])
    with pytest.raises(ValueError):
        proctitle.encode([])


def test_an_unknown_shim_launch_mode_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from cubeaccel.cubelet.runtime import RuntimeOptions, build_cubelet
    from cubeaccel.protocol.errors import CubeError

    with pytest.raises(CubeError) as refused:
        build_cubelet(RuntimeOptions(state_dir=tmp_path / "state", backend="emulated", shim_launch="thread"))
    assert refused.value.code == "cubelet.invalid_shim_launch"
    assert not (tmp_path / "state" / "cubelet.db").exists()


SILENT_SERVER = """
import socket, subprocess, sys, time
path, sid, spec = sys.argv[1:4]
s = socket.socket(socket.AF_UNIX); s.bind(path); s.listen(1)
print("listening", flush=True)
conn, _ = s.accept()
conn.recv(65536)
# It forks a shim (here: a stand-in with a shim's argv)... and its answer never comes.
sleeper = "import time; time.sleep(120)"
subprocess.Popen([sys.executable, "-c", sleeper, "cubeaccel.shim", "run", "--sandbox", sid, "--spec", spec])
time.sleep(120)
"""


def test_a_lost_answer_never_gives_a_sandbox_two_shims(tmp_path: Path) -> None:
    driver = ProcessShimDriver(tmp_path / "state")
    assert driver.forks is not None
    sid = f"lost-{os.getpid()}"
    spec = driver.dir / f"{sid}.json"
    silent = subprocess.Popen(
        [sys.executable, "-c", SILENT_SERVER, str(driver.dir / SOCKET_NAME), sid, str(spec)],
        stdout=subprocess.PIPE,
    )
    stand_in = None
    try:
        assert silent.stdout is not None and silent.stdout.readline() == b"listening\n"
        driver.forks._proc = silent  # the server this driver started, gone quiet
        driver.forks.launch = functools.partial(driver.forks.launch, reply_timeout_s=2.0)  # type: ignore[method-assign]
        driver.start(ShimSpec.model_validate(refused_spec(sid, tmp_path / "reports.sock")))
        assert driver.forks.unanswered and (driver.forks.last_refusal or "").startswith("no reply")
        assert silent.poll() is not None  # the quiet server was killed: nothing it forks later can run
        stand_in = find_shim(sid, under=driver.dir)
        assert stand_in is not None and sid not in driver._children  # found the forked one; spawned none
    finally:
        if stand_in is not None:
            os.kill(stand_in, 9)
        silent.kill()
        silent.wait()


def test_cubelet_serve_has_its_fork_server_up_before_the_first_start_and_takes_it_along(tmp_path: Path) -> None:
    from tests.support.cubelet_process import CubeletProcess

    (tmp_path / "node").mkdir()
    node = CubeletProcess(tmp_path / "node", "-", "--backend", "emulated").start()
    sock = tmp_path / "node" / "shims" / SOCKET_NAME

    def answers() -> bool:
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(sock))
            except OSError:
                return False
            return True

    try:
        poll(answers, 60, what="fork server listening before any sandbox start")
    finally:
        node.sigkill()  # as a crash: the fork server reads EOF on Cubelet's pipe and goes
    poll(lambda: not answers(), 30, what="fork server gone with its Cubelet")
