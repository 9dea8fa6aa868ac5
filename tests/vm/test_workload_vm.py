"""Workloads in a real MicroVM: the guest's cube-workload over its own virtio-serial port, through the shim's
bridge (`workload.sock` in the state dir), restored from a template snapshot (the token arrives after restore).

One VM for the module (a boot under TCG costs seconds); each test uses its own paths and commands. The last test
tears the VM down and checks that the device is still released after the workloads ran.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import stat
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from cubeaccel.images.manifest import Manifest
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms
from tests.vm.conftest import ShimRun, emulated_id
from tests.workload_client import Stream, WorkloadClient

pytestmark = pytest.mark.vm
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def vm(tmp_path_factory: pytest.TempPathFactory, guest_image: Manifest) -> Iterator[ShimRun]:
    base = tmp_path_factory.mktemp("wl")
    sandbox = f"w-{uuid.uuid4().hex[:10]}"
    spec = {
        "sandbox_id": sandbox,
        "devices": [
            {
                "device_id": emulated_id(7),
                "driver": "edu",
                "properties": {},
                "vendor_id": "1234",
                "device_id_hex": "11e8",
            }
        ],
        "memory_mib": 256,
        "vcpus": 1,
        "pin_memory": True,
        "image_manifest": str(guest_image.directory / "manifest.json"),
        "start": "template",
        "state_dir": str(base / "state"),
        "report": {"file": str(base / "reports.jsonl")},
        "detach_timeout_s": 10.0,
        "workload": True,
    }
    (base / "spec.json").write_text(json.dumps(spec))
    run = ShimRun(sandbox, base / "spec.json", base / "reports.jsonl", base / "state")
    run.workload_token = secrets.token_urlsafe(24)
    run.start()
    try:
        run.wait_for("guest_validated", 240)
        yield run
    finally:
        if run.proc is not None and run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
        kill_started_vmms(base)


def client(vm: ShimRun, timeout: float = 120.0) -> WorkloadClient:
    transport = httpx.HTTPTransport(uds=str(vm.state_dir / "workload.sock"))
    http = httpx.Client(transport=transport, base_url="http://workload", timeout=timeout)
    assert vm.workload_token is not None
    return WorkloadClient(http, vm.workload_token)


@pytest.fixture
def wl(vm: ShimRun) -> Iterator[WorkloadClient]:
    c = client(vm)
    yield c
    c.http.close()


def test_the_bridge_socket_is_private_and_ready_was_reported_before_validation(vm: ShimRun) -> None:
    mode = (vm.state_dir / "workload.sock").stat().st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    kinds = vm.kinds()
    assert kinds.index("workload_ready") < kinds.index("guest_validated")
    assert vm.one("workload_ready")["details"]["health_ms"] > 0


def test_echo_exit_code_and_stderr(wl: WorkloadClient) -> None:
    s = wl.run("echo hello")
    assert s.output() == b"hello\n" and s.end == {"exited": True, "status": "exit status 0"}
    s = wl.run("echo out; echo oops >&2; exit 3")
    assert s.output("stdout") == b"out\n" and s.output("stderr") == b"oops\n"
    assert s.end["exitCode"] == 3


def test_env_cwd_and_users(wl: WorkloadClient) -> None:
    s = wl.run('echo "$GREETING"; pwd; id -un', envs={"GREETING": "hi there"}, cwd="/tmp")
    assert s.output().decode().splitlines() == ["hi there", "/tmp", "user"]  # envd's default user
    s = wl.run("id -u; echo $HOME; pwd", user="root")
    assert s.output().decode().split() == ["0", "/root", "/root"]
    s = wl.run("id -u; pwd; stat -c %U ~", user="user")
    assert s.output().decode().split() == ["1000", "/home/user", "user"]


def test_ten_mib_of_output(wl: WorkloadClient) -> None:
    s = wl.run(f"head -c {10 * MiB} /dev/zero | tr '\\0' 'x'")
    assert s.output() == b"x" * (10 * MiB) and s.end["status"] == "exit status 0"


def test_stdin_is_passed(wl: WorkloadClient) -> None:
    body = {"process": {"cmd": "/bin/cat"}, "stdin": True}
    with wl.stream("process.Process/Start", body) as messages:
        pid = next(messages)["event"]["start"]["pid"]
        data = base64.b64encode(b"line one\n\xff\n").decode()
        assert wl.ok("process.Process/SendInput", {"process": {"pid": pid}, "input": {"stdin": data}}) == {}
        assert base64.b64decode(next(messages)["event"]["data"]["stdout"]) == b"line one\n\xff\n"
        assert wl.ok("process.Process/CloseStdin", {"process": {"pid": pid}}) == {}
        rest = list(messages)
    assert rest[-2]["event"]["end"]["status"] == "exit status 0"


def test_kill_of_a_running_command(wl: WorkloadClient) -> None:
    body = {"process": {"cmd": "/bin/bash", "args": ["-c", "sleep 1000 & echo started; wait"]}, "stdin": False}
    with wl.stream("process.Process/Start", body) as messages:
        pid = next(messages)["event"]["start"]["pid"]
        assert base64.b64decode(next(messages)["event"]["data"]["stdout"]) == b"started\n"
        assert wl.ok("process.Process/SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}) == {}
        events = list(messages)
    assert events[-2]["event"]["end"]["status"] == "signal: killed"
    left = wl.run("pgrep -f 'sleep 1000' || echo none", user="root")
    assert left.output() == b"none\n"  # the group died: the background sleep too


def test_sixteen_concurrent_commands(vm: ShimRun) -> None:
    results: dict[int, bytes] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        c = client(vm)
        try:
            s = c.run(f"echo start {i}; sleep 1; echo done {i}")
            results[i] = s.output()
        except BaseException as exc:
            errors.append(exc)
        finally:
            c.http.close()

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert results == {i: f"start {i}\ndone {i}\n".encode() for i in range(16)}
    assert time.monotonic() - t0 < 60  # concurrent, not 16 one after the other behind a lock


def test_five_mib_binary_file_round_trip(wl: WorkloadClient) -> None:
    blob = os.urandom(5 * MiB)
    path = f"/tmp/rt-{uuid.uuid4().hex[:6]}/blob.bin"
    r = wl.http.post(
        "/files",
        params={"path": path},
        content=blob,
        headers=wl.headers({"Content-Type": "application/octet-stream"}),
    )
    assert r.status_code == 200, r.text
    s = wl.run(f"sha256sum {path} | cut -d' ' -f1")
    assert s.output().decode().strip() == hashlib.sha256(blob).hexdigest()
    back = wl.http.get("/files", params={"path": path}, headers=wl.headers({"Accept-Encoding": "identity"}))
    assert back.status_code == 200 and back.content == blob


def test_list_stat_mkdir_move_remove(wl: WorkloadClient) -> None:
    d = f"/tmp/fs-{uuid.uuid4().hex[:6]}"
    made = wl.ok("filesystem.Filesystem/MakeDir", {"path": f"{d}/sub"})["entry"]
    assert made["type"] == "FILE_TYPE_DIRECTORY"
    assert wl.unary("filesystem.Filesystem/MakeDir", {"path": f"{d}/sub"}).json()["code"] == "already_exists"
    wl.run(f"printf abc > {d}/sub/f.txt")
    entry = wl.ok("filesystem.Filesystem/Stat", {"path": f"{d}/sub/f.txt"})["entry"]
    assert entry["type"] == "FILE_TYPE_FILE" and entry["size"] == "3"
    names = {e["name"] for e in wl.ok("filesystem.Filesystem/ListDir", {"path": d, "depth": 2})["entries"]}
    assert names == {"sub", "f.txt"}
    wl.ok("filesystem.Filesystem/Move", {"source": f"{d}/sub/f.txt", "destination": f"{d}/new/g.txt"})
    assert wl.ok("filesystem.Filesystem/Stat", {"path": f"{d}/new/g.txt"})["entry"]["size"] == "3"
    assert wl.ok("filesystem.Filesystem/Remove", {"path": d}) == {}
    assert wl.unary("filesystem.Filesystem/Stat", {"path": d}).json()["code"] == "not_found"


@pytest.mark.parametrize("token", ["", "wrong-token"])
def test_missing_or_wrong_token_is_refused(wl: WorkloadClient, token: str) -> None:
    r = wl.unary("process.Process/List", {}, token=token)
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    marker = f"/tmp/must-not-exist-{uuid.uuid4().hex[:6]}"
    s = wl.collect("process.Process/Start", {"process": {"cmd": "/usr/bin/touch", "args": [marker]}}, token=token)
    assert s.error is not None and s.error["code"] == "unauthenticated"
    r = wl.http.get("/files", params={"path": "/etc/passwd"}, headers={"X-Access-Token": token} if token else {})
    assert r.status_code == 401
    assert wl.run(f"test -e {marker} && echo yes || echo no").output() == b"no\n"


def test_commands_do_not_inherit_the_services_environment(wl: WorkloadClient) -> None:
    """The guest init exports PYTHONPATH and friends for the services; a command must see none of it."""
    env = dict(line.split("=", 1) for line in wl.run("env").output().decode().splitlines() if "=" in line)
    assert env["HOME"] == "/home/user" and env["USER"] == "user"
    leaked = sorted(k for k in env if k.startswith(("PYTHON", "CUBE")))
    assert leaked == []


def test_a_bare_command_name_runs_the_images_binary_with_its_argv0(wl: WorkloadClient) -> None:
    """Commands pass a busybox gate (workload/limits.py); busybox ash would run its own applet for a bare name, so
    the service resolves it on PATH first: `ls` is coreutils' ls, and argv[0] stays what the caller sent."""
    out = wl.collect("process.Process/Start", {"process": {"cmd": "ls", "args": ["--version"]}, "stdin": False})
    assert out.output().startswith(b"ls (GNU coreutils)"), out.output()[:200]
    body = {"process": {"cmd": "bash", "args": ["-c", 'echo "$0" "$BASH"']}, "stdin": False}
    assert wl.collect("process.Process/Start", body).output() == b"bash /bin/bash\n"


PORT_PROBE = (
    "import errno, os, sys\n"
    "name = sys.argv[1]\n"
    "for d in os.listdir('/sys/class/virtio-ports'):\n"
    "    if open(f'/sys/class/virtio-ports/{d}/name').read().strip() == name:\n"
    "        try:\n"
    "            fd = os.open(f'/dev/{d}', os.O_RDWR | os.O_NONBLOCK)\n"
    "        except OSError as e:\n"
    "            print(f'/dev/{d}', errno.errorcode[e.errno])\n"
    "        else:\n"
    "            print(f'/dev/{d}', 'OPENED')\n"
    "        break\n"
    "else:\n"
    "    print('no port', name)\n"
)


@pytest.mark.parametrize(("user", "refusal"), [("user", "EACCES"), ("root", "EBUSY")])
def test_a_workload_cannot_open_the_validation_agents_port(wl: WorkloadClient, user: str, refusal: str) -> None:
    """cube-agent's virtio port is root-only (a user gets EACCES), and cube-agent holds it open, so even root in
    the guest gets EBUSY: a virtio-serial port has one opener. (The workload service's own port: the same.)"""
    for port in ("cube-agent", "org.cubeaccel.workload.0"):
        body = {"process": {"cmd": "/usr/bin/python3", "args": ["-c", PORT_PROBE, port]}, "stdin": False}
        headers = {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}
        out = wl.collect("process.Process/Start", body, headers=headers).output().decode().split()
        assert len(out) == 2 and out[0].startswith("/dev/vport"), out  # the port is there: a real refusal
        assert out[1] == refusal, (port, out)


def test_sixty_four_concurrent_commands(vm: ShimRun) -> None:
    """64 commands alive at once: each waits until all 64 have started (a barrier in /tmp), so any cap or
    serialisation below 64 in the bridge, the mux or the service deadlocks this test into its timeout."""
    barrier = f"/tmp/b64-{uuid.uuid4().hex[:6]}"
    wl0 = client(vm)
    wl0.run(f"mkdir -p {barrier}")
    wl0.http.close()
    results: dict[int, bytes] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        c = client(vm, timeout=300)
        try:
            script = f"touch {barrier}/{i}; while [ $(ls {barrier} | wc -l) -lt 64 ]; do sleep 0.5; done; echo n{i}"
            body = {"process": {"cmd": "/bin/sh", "args": ["-c", script]}, "stdin": False}  # busybox: small
            results[i] = c.collect("process.Process/Start", body, headers={"Connect-Timeout-Ms": "240000"}).output()
        except BaseException as exc:
            errors.append(exc)
        finally:
            c.http.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == [], vm.log_tail()
    assert results == {i: f"n{i}\n".encode() for i in range(64)}


def test_a_fork_bomb_is_contained_and_the_sandbox_still_runs_commands(vm: ShimRun, wl: WorkloadClient) -> None:
    """As root (whom RLIMIT_NPROC does not stop): the commands' cgroup caps the tasks, the guest service keeps
    answering, the timeout's SIGKILL of the group ends it, and the sandbox runs the next command."""
    group = "/sys/fs/cgroup/cube-workload"
    limits = wl.run(f"cat {group}/pids.max {group}/memory.max", user="root").output().split()
    assert int(limits[0]) == 512 and int(limits[1]) > 0, limits
    done: list[object] = []

    def bomb() -> None:
        c = client(vm, timeout=300)
        try:
            done.append(c.run(":(){ :|:& };:", timeout_ms=30_000, user="root"))
        except BaseException as exc:
            done.append(exc)
        finally:
            c.http.close()

    t0 = time.monotonic()
    thread = threading.Thread(target=bomb)
    thread.start()
    during = client(vm, timeout=120)
    try:
        # while it runs: the service still answers, and a limit was hit: failed forks (pids.events) or OOM kills
        # inside the group (memory.events; the guest's shell pages are shmem, so memory often runs out first)
        def capped() -> dict[str, int] | None:
            script = (
                f"echo current $(cat {group}/pids.current);"
                f"while read k v; do echo pids_$k $v; done < {group}/pids.events;"
                f"while read k v; do echo mem_$k $v; done < {group}/memory.events"
            )
            words = during.run(script, user="root").output().decode().split()
            seen = {k: int(v) for k, v in zip(words[0::2], words[1::2], strict=True)}
            return seen if seen.get("pids_max", 0) > 0 or seen.get("mem_oom_kill", 0) > 0 else None

        seen = poll(capped, 90, every_s=1.0, what="the bomb reached a limit of its group")
        assert seen["current"] <= 512, seen
        health_t0 = time.monotonic()
        assert during.http.get("/health").status_code == 204
        health_s = time.monotonic() - health_t0
    finally:
        during.http.close()
    thread.join(180)
    assert len(done) == 1 and isinstance(done[0], Stream), done
    # the bomb's first shell returns at once (exit 0); its children hold the output open until the timeout's
    # SIGKILL of the group ends them all; the stream then ends as envd ends a command past its deadline
    # (`deadline_exceeded`, issue 29), or with the end event if the group was gone first
    bomb_stream = done[0]
    ended = [e["event"]["end"]["status"] for e in bomb_stream.events if "end" in e["event"]]
    deadline = (bomb_stream.error or {}).get("code") == "deadline_exceeded"
    assert deadline or ended in (["exit status 0"], ["signal: killed"]), (bomb_stream.kinds(), bomb_stream.error)
    assert time.monotonic() - t0 >= 25
    assert time.monotonic() - t0 < 150

    def drained() -> bool:
        return int(wl.run(f"cat {group}/pids.current", user="root").output()) <= 2  # `cat` and its bash

    poll(drained, 60, every_s=1.0, what="the bomb's processes are gone")
    assert wl.run("echo alive").output() == b"alive\n"
    print(f"fork bomb: {seen}; /health answered in {health_s:.2f} s during it")


def test_the_channel_recovers_when_the_guest_service_restarts(wl: WorkloadClient, vm: ShimRun) -> None:
    """The service is killed inside the guest; init starts a new one, which says GOAWAY on the port; the shim's
    bridge reconnects and sends the token again, so the next call works, served by the new process."""
    before = int(wl.run("echo $PPID").output())
    wl.run(f"(sleep 1; kill -9 {before}) </dev/null >/dev/null 2>&1 &", user="root")

    def served_by_a_new_service() -> int | None:
        c = client(vm, timeout=30)
        try:
            pid = int(c.run("echo $PPID").output())
        except (AssertionError, httpx.HTTPError, ValueError):
            return None
        finally:
            c.http.close()
        return pid if pid != before else None

    after = poll(served_by_a_new_service, 120, every_s=1.0, what="a call served by the restarted service")
    assert after != before
    assert wl.run("echo again").output() == b"again\n"


def test_teardown_still_releases_the_device_after_workloads(vm: ShimRun, wl: WorkloadClient) -> None:
    body = {"process": {"cmd": "/bin/sleep", "args": ["1000"]}, "stdin": False}
    with wl.stream("process.Process/Start", body) as messages:
        next(messages)  # a command still running when the sandbox goes away
        assert vm.terminate(90) == 0
    kinds = vm.kinds()
    assert "device_detached" in kinds and "vmm_exited" in kinds, kinds
    assert vm.one("shim_exiting")["details"]["reason"] == "stop_requested"
    assert not (vm.state_dir / "workload.sock").exists()
    with pytest.raises(httpx.TransportError):
        wl.http.get("/health")
