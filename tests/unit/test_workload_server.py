"""cube-workload as a real subprocess on a unix socket, driven over HTTP/1.1 by httpx as the E2B SDK drives envd.

One server per module (starting Python costs); every test uses its own paths under tmp and its own commands.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.workload_client import ServerProcess, WorkloadClient, workload_server

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with workload_server(tmp_path_factory.mktemp("workload")) as srv:
        yield srv


@pytest.fixture
def wl(server: ServerProcess) -> Iterator[WorkloadClient]:
    client = server.client()
    yield client
    client.http.close()


def wait_until(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def pid_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


# ---- health and tokens ---------------------------------------------------------------------------------------


def test_health_needs_no_token(wl: WorkloadClient) -> None:
    r = wl.http.get("/health")
    assert r.status_code == 204 and r.content == b""


@pytest.mark.parametrize("token", ["", "wrong-token"])
def test_missing_or_wrong_token_is_refused_everywhere(wl: WorkloadClient, token: str, tmp_path: Path) -> None:
    r = wl.unary("process.Process/List", {}, token=token)
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    r = wl.unary("filesystem.Filesystem/Stat", {"path": "/"}, token=token)
    assert r.json()["code"] == "unauthenticated"
    marker = tmp_path / "must-not-exist"
    s = wl.collect("process.Process/Start", {"process": {"cmd": "/usr/bin/touch", "args": [str(marker)]}}, token=token)
    assert s.events == [] and s.error is not None and s.error["code"] == "unauthenticated"
    assert not marker.exists()
    (tmp_path / "secret").write_bytes(b"s3cret")
    r = wl.http.get(
        "/files", params={"path": str(tmp_path / "secret")}, headers={"X-Access-Token": token} if token else {}
    )
    assert r.status_code == 401 and r.json()["code"] == 401 and b"s3cret" not in r.content
    r = wl.http.post(
        "/files",
        params={"path": str(marker)},
        content=b"x",
        headers={"X-Access-Token": token, "Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 401 and not marker.exists()


def test_signed_file_urls_as_envd_signs_them(wl: WorkloadClient, tmp_path: Path) -> None:
    path = str(tmp_path / "signed.bin")
    Path(path).write_bytes(b"signed content")

    def sign(op: str, exp: int | None = None) -> str:
        fields = [path, op, "", wl.token] + ([str(exp)] if exp is not None else [])
        return "v1_" + base64.b64encode(hashlib.sha256(":".join(fields).encode()).digest()).decode().rstrip("=")

    r = wl.http.get("/files", params={"path": path, "signature": sign("read")})
    assert r.status_code == 200 and r.content == b"signed content"
    assert wl.http.get("/files", params={"path": path, "signature": sign("write")}).status_code == 401
    expired = int(time.time()) - 5
    r = wl.http.get(
        "/files", params={"path": path, "signature": sign("read", expired), "signature_expiration": expired}
    )
    assert r.status_code == 401 and "expired" in r.json()["message"]


# ---- commands ------------------------------------------------------------------------------------------------


def test_echo_start_data_end(wl: WorkloadClient) -> None:
    s = wl.run("echo hello")
    assert s.error is None and s.trailer_seen
    assert s.kinds()[0] == "start" and s.kinds()[-1] == "end" and s.pid > 0
    assert s.output() == b"hello\n"
    assert s.end == {"exited": True, "status": "exit status 0"}  # exitCode 0 is a default: omitted


def test_nonzero_exit_and_stderr(wl: WorkloadClient) -> None:
    s = wl.run("echo out; echo oops >&2; exit 3")
    assert s.output("stdout") == b"out\n" and s.output("stderr") == b"oops\n"
    assert s.end == {"exitCode": 3, "exited": True, "status": "exit status 3", "error": "exit status 3"}


def test_env_and_cwd(wl: WorkloadClient, tmp_path: Path) -> None:
    s = wl.run('echo "$GREETING"; pwd; echo "$HOME $USER"', envs={"GREETING": "hi there"}, cwd=str(tmp_path))
    lines = s.output().decode().splitlines()
    assert lines[0] == "hi there" and lines[1] == str(tmp_path)
    assert lines[2].split()[1] == "root" if os.geteuid() == 0 else True


def test_missing_cwd_and_unknown_user_and_command(wl: WorkloadClient, tmp_path: Path) -> None:
    s = wl.run("true", cwd=str(tmp_path / "nope"))
    assert s.events == [] and s.error is not None and s.error["code"] == "invalid_argument"
    assert "does not exist" in s.error["message"]
    s = wl.run("true", user="no-such-user-here")
    assert s.error is not None and s.error["code"] == "unauthenticated"
    s = wl.collect("process.Process/Start", {"process": {"cmd": str(tmp_path / "no-binary")}})
    assert s.error is not None and s.error["code"] == "invalid_argument"


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_runs_as_the_requested_user(wl: WorkloadClient, tmp_path: Path) -> None:
    s = wl.run("id -u; id -g; echo $USER", user="nobody", cwd="/")
    uid, gid, name = s.output().decode().split()
    import pwd

    entry = pwd.getpwnam("nobody")
    assert (int(uid), int(gid), name) == (entry.pw_uid, entry.pw_gid, "nobody")


def test_binary_and_invalid_utf8_output(wl: WorkloadClient) -> None:
    s = wl.run(r"printf '\xff\xfe\x00\xc3\x28end'")
    assert s.output() == b"\xff\xfe\x00\xc3\x28end"


def test_stdin_send_input_and_close(wl: WorkloadClient) -> None:
    body = {"process": {"cmd": "/bin/cat"}, "stdin": True}
    with wl.stream("process.Process/Start", body) as messages:
        start = next(messages)
        pid = start["event"]["start"]["pid"]
        data = base64.b64encode(b"line one\n\xff\n").decode()
        assert wl.ok("process.Process/SendInput", {"process": {"pid": pid}, "input": {"stdin": data}}) == {}
        first = next(messages)
        assert base64.b64decode(first["event"]["data"]["stdout"]) == b"line one\n\xff\n"
        assert wl.ok("process.Process/CloseStdin", {"process": {"pid": pid}}) == {}
        rest = list(messages)
    assert rest[-1] == {"__end__": {}}
    assert rest[-2]["event"]["end"]["status"] == "exit status 0"


def test_kill_reaches_the_whole_process_group(wl: WorkloadClient, tmp_path: Path) -> None:
    child = tmp_path / "child.pid"
    script = f"sleep 1000 & echo $! > {child}; echo started; wait"
    body = {"process": {"cmd": "/bin/bash", "args": ["-c", script]}, "stdin": False}
    with wl.stream("process.Process/Start", body) as messages:
        pid = next(messages)["event"]["start"]["pid"]
        assert base64.b64decode(next(messages)["event"]["data"]["stdout"]) == b"started\n"
        sleeper = int(child.read_text())
        listed = wl.ok("process.Process/List", {})["processes"]
        assert any(p["pid"] == pid and p["config"]["cmd"] == "/bin/bash" for p in listed)
        assert wl.ok("process.Process/SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}) == {}
        events = list(messages)
    end = events[-2]["event"]["end"]
    assert end == {"exitCode": -1, "status": "signal: killed", "error": "signal: killed"}
    wait_until(lambda: pid_gone(sleeper), what="the background child to die with its group")
    assert all(p["pid"] != pid for p in wl.ok("process.Process/List", {}).get("processes", []))
    r = wl.unary("process.Process/SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGTERM"})
    assert r.status_code == 404 and r.json()["code"] == "not_found"


def test_timeout_kills_a_command_that_never_exits(wl: WorkloadClient) -> None:
    """The stream ends as envd's does at its deadline (`deadline_exceeded`, not the exit), and the command dies."""
    started = time.monotonic()
    s = wl.run("sleep 1000", timeout_ms=300)
    assert s.kinds() == ["start"] and s.error is not None, s
    assert s.error == {"code": "deadline_exceeded", "message": "context deadline exceeded"}
    assert time.monotonic() - started < 10
    again = wl.collect("process.Process/Connect", {"process": {"pid": s.pid}})
    assert again.end["status"] == "signal: killed"  # killed by the same deadline, kept for a later Connect


def test_keepalive_when_idle(wl: WorkloadClient) -> None:
    s = wl.collect(
        "process.Process/Start",
        {"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 1.3; echo late"]}},
        headers={"Keepalive-Ping-Interval": "1"},
    )
    assert s.kinds() == ["start", "keepalive", "data", "end"]
    assert s.events[1] == {"event": {"keepalive": {}}}


def test_connect_reattaches_by_pid_and_by_tag(wl: WorkloadClient) -> None:
    body = {"process": {"cmd": "/bin/sh", "args": ["-c", "read x; echo got $x"]}, "stdin": True, "tag": "reattach-me"}
    with wl.stream("process.Process/Start", body) as first:
        pid = next(first)["event"]["start"]["pid"]
        with wl.stream("process.Process/Connect", {"process": {"tag": "reattach-me"}}) as second:
            assert next(second) == {"event": {"start": {"pid": pid}}}
            wl.ok(
                "process.Process/SendInput",
                {"process": {"pid": pid}, "input": {"stdin": base64.b64encode(b"it\n").decode()}},
            )
            rest = list(second)
        assert base64.b64decode(rest[0]["event"]["data"]["stdout"]) == b"got it\n"
        assert rest[-2]["event"]["end"]["status"] == "exit status 0"
        list(first)
    late = wl.collect("process.Process/Connect", {"process": {"pid": pid}})  # exited: start + retained end
    assert late.kinds() == ["start", "end"] and late.error is None
    missing = wl.collect("process.Process/Connect", {"process": {"pid": 2**31}})
    assert missing.error is not None and missing.error["code"] == "not_found"


def test_ten_mib_of_output_is_streamed_with_backpressure(
    wl: WorkloadClient, server: ServerProcess, tmp_path: Path
) -> None:
    marker = tmp_path / "finished"
    script = f"head -c {10 * MiB} /dev/urandom; touch {marker}"
    body = {"process": {"cmd": "/bin/sh", "args": ["-c", script]}, "stdin": False}
    with wl.stream("process.Process/Start", body) as messages:
        next(messages)  # start
        got = len(base64.b64decode(next(messages)["event"]["data"]["stdout"]))
        # the reader pauses: the command must block in write(2), not finish into a server-side buffer
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert not marker.exists(), "the command ran to the end while nobody read its output"
            time.sleep(0.05)
        end: dict[str, Any] = {}
        for msg in messages:
            if "event" in msg and "data" in msg["event"]:
                got += len(base64.b64decode(msg["event"]["data"]["stdout"]))
            elif "event" in msg and "end" in msg["event"]:
                end = msg["event"]["end"]
    assert got == 10 * MiB and end["status"] == "exit status 0" and marker.exists()
    assert server.rss_kib("VmHWM") < 64 * 1024  # ~24 MiB at start; 10 MiB went through without being held


def test_sixteen_concurrent_commands(wl: WorkloadClient, server: ServerProcess) -> None:
    results: dict[int, bytes] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        client = server.client()
        try:
            s = client.run(f"echo start {i}; sleep 0.3; echo done {i}")
            assert s.end["status"] == "exit status 0"
            results[i] = s.output()
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.http.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert results == {i: f"start {i}\ndone {i}\n".encode() for i in range(16)}


def test_sixty_four_commands_alive_at_once(wl: WorkloadClient, server: ServerProcess) -> None:
    clients = [server.client() for _ in range(64)]
    streams = []
    try:
        pids = []
        for i, client in enumerate(clients):
            body = {"process": {"cmd": "/bin/sh", "args": ["-c", "read x; echo $x"]}, "stdin": True, "tag": f"c64-{i}"}
            cm = client.stream("process.Process/Start", body)
            messages = cm.__enter__()
            streams.append((cm, messages))
            pids.append(next(messages)["event"]["start"]["pid"])
        listed = {p["pid"] for p in wl.ok("process.Process/List", {})["processes"]}
        assert set(pids) <= listed
        for i, pid in enumerate(pids):
            data = base64.b64encode(f"n{i}\n".encode()).decode()
            wl.ok("process.Process/SendInput", {"process": {"pid": pid}, "input": {"stdin": data}})
        for i, (_, messages) in enumerate(streams):
            rest = list(messages)
            assert base64.b64decode(rest[0]["event"]["data"]["stdout"]) == f"n{i}\n".encode()
    finally:
        for cm, _ in streams:
            cm.__exit__(None, None, None)
        for client in clients:
            client.http.close()


# ---- files ---------------------------------------------------------------------------------------------------


def test_five_mib_binary_round_trip_multipart_and_raw(wl: WorkloadClient, tmp_path: Path) -> None:
    blob = os.urandom(5 * MiB)
    dest = tmp_path / "deep" / "er" / "blob.bin"
    r = wl.http.post("/files", params={"path": str(dest)}, files={"file": ("blob.bin", blob)}, headers=wl.headers())
    assert r.status_code == 200, r.text
    assert r.json() == [{"path": str(dest), "name": "blob.bin", "type": "file"}]
    assert dest.read_bytes() == blob
    plain = wl.http.get("/files", params={"path": str(dest)}, headers=wl.headers({"Accept-Encoding": "identity"}))
    assert plain.status_code == 200 and plain.headers["content-length"] == str(5 * MiB) and plain.content == blob
    zipped = wl.http.get("/files", params={"path": str(dest)}, headers=wl.headers({"Accept-Encoding": "gzip"}))
    assert zipped.headers["content-encoding"] == "gzip" and zipped.content == blob  # httpx gunzips
    raw = tmp_path / "raw.bin"
    r = wl.http.post(
        "/files",
        params={"path": str(raw)},
        content=gzip.compress(blob, 1),
        headers=wl.headers({"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"}),
    )
    assert r.status_code == 200 and raw.read_bytes() == blob


def test_multipart_with_paths_in_filenames(wl: WorkloadClient, tmp_path: Path) -> None:
    a, b = tmp_path / "m" / "a.txt", tmp_path / "m" / "b.txt"
    files = [("file", (str(a), b"A" * 70_000)), ("other", ("x", b"ignored")), ("file", (str(b), b"--B--\r\n"))]
    r = wl.http.post("/files", files=files, headers=wl.headers())
    assert r.status_code == 200, r.text
    assert [e["path"] for e in r.json()] == [str(a), str(b)]
    assert a.read_bytes() == b"A" * 70_000 and b.read_bytes() == b"--B--\r\n"


def test_download_errors(wl: WorkloadClient, tmp_path: Path) -> None:
    r = wl.http.get("/files", params={"path": str(tmp_path / "missing")}, headers=wl.headers())
    assert r.status_code == 404 and "does not exist" in r.json()["message"]
    r = wl.http.get("/files", params={"path": str(tmp_path)}, headers=wl.headers())
    assert r.status_code == 400 and "is a directory" in r.json()["message"]
    r = wl.http.get("/files", params={"path": "x", "username": "no-such-user"}, headers=wl.headers())
    assert r.status_code == 401


def test_filesystem_operations(wl: WorkloadClient, tmp_path: Path) -> None:
    d = tmp_path / "fs"
    made = wl.ok("filesystem.Filesystem/MakeDir", {"path": str(d / "sub")})["entry"]
    assert made["type"] == "FILE_TYPE_DIRECTORY" and made["path"] == str(d / "sub") and made["name"] == "sub"
    again = wl.unary("filesystem.Filesystem/MakeDir", {"path": str(d / "sub")})
    assert again.status_code == 409 and again.json()["code"] == "already_exists"
    (d / "sub" / "f.txt").write_bytes(b"12345")
    (d / "link").symlink_to(d / "sub")
    entry = wl.ok("filesystem.Filesystem/Stat", {"path": str(d / "sub" / "f.txt")})["entry"]
    assert entry["type"] == "FILE_TYPE_FILE" and entry["size"] == "5" and entry["permissions"].startswith("-rw")
    assert entry["modifiedTime"].endswith("Z") and isinstance(entry["mode"], int)
    link = wl.ok("filesystem.Filesystem/Stat", {"path": str(d / "link")})["entry"]
    assert link["type"] == "FILE_TYPE_DIRECTORY" and link["symlinkTarget"] == str(d / "sub")
    assert link["permissions"].startswith("L")
    one = wl.ok("filesystem.Filesystem/ListDir", {"path": str(d)})["entries"]
    assert [e["name"] for e in one] == ["link", "sub"]
    two = wl.ok("filesystem.Filesystem/ListDir", {"path": str(d), "depth": 2})["entries"]
    assert [e["path"] for e in two] == [str(d / "link"), str(d / "sub"), str(d / "sub" / "f.txt")]  # link not followed
    via_link = wl.ok("filesystem.Filesystem/ListDir", {"path": str(d / "link")})["entries"]
    assert [e["path"] for e in via_link] == [str(d / "link" / "f.txt")]  # requested path kept
    moved = wl.ok(
        "filesystem.Filesystem/Move", {"source": str(d / "sub" / "f.txt"), "destination": str(d / "new" / "g.txt")}
    )
    assert moved["entry"]["path"] == str(d / "new" / "g.txt") and (d / "new" / "g.txt").read_bytes() == b"12345"
    r = wl.unary("filesystem.Filesystem/Move", {"source": str(d / "gone"), "destination": str(d / "x")})
    assert r.json()["code"] == "not_found"
    assert wl.ok("filesystem.Filesystem/Remove", {"path": str(d / "new")}) == {}
    assert not (d / "new").exists() and (d / "sub").is_dir()
    r = wl.unary("filesystem.Filesystem/Stat", {"path": str(d / "new")})
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = wl.unary("filesystem.Filesystem/ListDir", {"path": str(d / "link" / "..x")})
    assert r.json()["code"] == "not_found"
    assert wl.ok("filesystem.Filesystem/Stat", {"path": str(d / "sub" / ".." / "link")})["entry"]["name"] == "link"


def test_dotdot_and_home_relative_paths(wl: WorkloadClient) -> None:
    home = os.path.expanduser("~")
    assert wl.ok("filesystem.Filesystem/Stat", {"path": "~"})["entry"]["path"] == home
    assert wl.ok("filesystem.Filesystem/Stat", {"path": "../../../../../../.."})["entry"]["path"] == "/"
    r = wl.unary("filesystem.Filesystem/Stat", {"path": "~otheruser/x"})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"


def test_unknown_routes_and_methods(wl: WorkloadClient) -> None:
    r = wl.unary("filesystem.Filesystem/WatchDir", {"path": "/"})  # a server stream, asked as unary
    assert r.status_code == 415
    r = wl.unary("filesystem.Filesystem/Chown", {"path": "/"})
    assert r.status_code == 501 and r.json()["code"] == "unimplemented"
    r = wl.http.post(
        "/process.Process/List", content=b"\x00", headers=wl.headers({"Content-Type": "application/proto"})
    )
    assert r.status_code == 415
    r = wl.unary("process.Process/SendSignal", {"process": {"pid": 1}, "signal": "SIGNAL_BOGUS"})
    assert r.json()["code"] in ("invalid_argument", "not_found")
    r = wl.http.post(
        "/process.Process/List", content=b"{not json", headers=wl.headers({"Content-Type": "application/json"})
    )
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    assert wl.http.get("/nope").status_code == 404
    r = wl.unary("filesystem.Filesystem/Stat", {"path": "/tmp/nul\u0000byte"})  # lstat raises ValueError
    assert r.status_code == 500 and r.json()["code"] == "internal"
    s = wl.collect("process.Process/Start", {"process": {"cmd": "/bin/echo", "args": ["a\u0000b"]}})
    assert s.error is not None and s.error["code"] == "invalid_argument"
    # the connection is still good after all of that
    assert wl.ok("process.Process/List", {}) is not None and json.dumps(wl.ok("process.Process/List", {}))


def raw_exchange(server: ServerProcess, data: bytes) -> bytes:
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(str(server.socket_path))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused before it read it all
            s.sendall(data)
        out = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                out += chunk
        return out


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /health HTTP/1.1\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n", b"431"),
        (b"GET /health HTTP/1.1\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(200)) + b"\r\n", b"431"),
        (b"GARBAGE\r\n\r\n", b"400"),
        (b"GET /health HTTP/2.0\r\n\r\n", b"505"),
        (b"POST /process.Process/List HTTP/1.1\r\nContent-Length: -5\r\n\r\n", b"400"),
    ],
)
def test_malformed_http_is_refused_and_the_server_stays_up(
    server: ServerProcess, wl: WorkloadClient, request_bytes: bytes, status: bytes
) -> None:
    reply = raw_exchange(server, request_bytes)
    assert reply.split(b" ", 2)[1].startswith(status), reply[:200]
    assert wl.http.get("/health").status_code == 204


def test_an_oversized_unary_body_is_refused_without_buffering_it(server: ServerProcess, wl: WorkloadClient) -> None:
    head = (
        b"POST /process.Process/SendInput HTTP/1.1\r\nContent-Type: application/json\r\n"
        b"X-Access-Token: " + wl.token.encode() + b"\r\nContent-Length: 104857600\r\n\r\n"
    )
    reply = raw_exchange(server, head + b"x" * (5 * MiB))
    assert b" 429 " in reply.split(b"\r\n", 1)[0] and b"resource_exhausted" in reply
    assert server.rss_kib("VmHWM") < 64 * 1024
    assert wl.http.get("/health").status_code == 204


def test_pty_sessions_resize_and_take_input(wl: WorkloadClient) -> None:
    script = "stty size; cut -d' ' -f7 /proc/$$/stat; read x; stty size; echo got $x"
    body = {"process": {"cmd": "/bin/bash", "args": ["-c", script]}, "pty": {"size": {"cols": 100, "rows": 30}}}
    with wl.stream("process.Process/Start", body) as messages:
        pid = next(messages)["event"]["start"]["pid"]
        seen = b""
        while seen.count(b"\r\n") < 2:
            seen += base64.b64decode(next(messages)["event"]["data"]["pty"])
        assert seen.startswith(b"30 100\r\n")  # a terminal: CRLF
        assert int(seen.split(b"\r\n")[1]) != 0  # tty_nr: the pty is the controlling terminal
        sel = {"process": {"pid": pid}}
        assert wl.ok("process.Process/Update", {**sel, "pty": {"size": {"cols": 120, "rows": 40}}}) == {}
        r = wl.unary("process.Process/SendInput", {**sel, "input": {"stdin": base64.b64encode(b"x").decode()}})
        assert r.json()["code"] == "internal"  # a pty command takes pty input only
        assert wl.unary("process.Process/CloseStdin", sel).json()["code"] == "unknown"
        wl.ok("process.Process/SendInput", {**sel, "input": {"pty": base64.b64encode(b"go\n").decode()}})
        rest = list(messages)
    out = seen + b"".join(base64.b64decode(m["event"]["data"]["pty"]) for m in rest if "data" in m.get("event", {}))
    assert b"40 120\r\n" in out and b"got go\r\n" in out
    assert rest[-2]["event"]["end"]["status"] == "exit status 0"
    r = wl.unary("process.Process/Update", {"process": {"pid": pid}, "pty": {"size": {"cols": 1, "rows": 1}}})
    assert r.json()["code"] == "not_found"


def test_stream_input_applies_envelopes_in_order(wl: WorkloadClient) -> None:
    from cubeaccel.workload.connect import encode_envelope

    body = {"process": {"cmd": "/bin/cat"}, "stdin": True}
    with wl.stream("process.Process/Start", body) as messages:
        pid = next(messages)["event"]["start"]["pid"]

        def envelopes() -> Iterator[bytes]:
            yield encode_envelope({"start": {"process": {"pid": pid}}})
            for piece in (b"first ", b"second\n"):
                yield encode_envelope({"data": {"input": {"stdin": base64.b64encode(piece).decode()}}})
                yield encode_envelope({"keepalive": {}})

        r = wl.http.post(
            "/process.Process/StreamInput",
            content=envelopes(),
            headers=wl.headers({"Content-Type": "application/connect+json"}),
        )
        assert r.status_code == 200 and r.content == encode_envelope({}) + b"\x02\x00\x00\x00\x02{}"
        wl.ok("process.Process/CloseStdin", {"process": {"pid": pid}})
        rest = list(messages)
    out = b"".join(base64.b64decode(m["event"]["data"]["stdout"]) for m in rest if "data" in m.get("event", {}))
    assert out == b"first second\n"
    r = wl.http.post(
        "/process.Process/StreamInput",
        content=encode_envelope({"data": {"input": {"stdin": "eA=="}}}),
        headers=wl.headers({"Content-Type": "application/connect+json"}),
    )
    assert r.status_code == 200 and b'"failed_precondition"' in r.content


def test_watch_dir_streams_fsnotify_events_until_its_deadline(wl: WorkloadClient, tmp_path: Path) -> None:
    """The stream form (the async SDK's): start, events as they happen (with entries), keepalives, and
    `deadline_exceeded` when Connect-Timeout-Ms passes."""
    watched = tmp_path / "watched"
    watched.mkdir()
    body = {"path": str(watched), "includeEntry": True}
    headers = {"Connect-Timeout-Ms": "2500", "Keepalive-Ping-Interval": "1"}
    seen: list[dict[str, Any]] = []
    with wl.stream("filesystem.Filesystem/WatchDir", body, headers=headers) as messages:
        assert next(messages) == {"start": {}}  # envd's WatchDirResponse: its oneof's fields, no "event" key
        (watched / "f.txt").write_text("hello")
        (watched / "f.txt").unlink()
        seen.extend(messages)
    end = seen.pop()["__end__"]
    assert end == {"error": {"code": "deadline_exceeded", "message": "context deadline exceeded"}}
    events = [m["filesystem"] for m in seen if "filesystem" in m]
    assert [(e["type"], e["name"]) for e in events] == [
        ("EVENT_TYPE_CREATE", "f.txt"),
        ("EVENT_TYPE_WRITE", "f.txt"),
        ("EVENT_TYPE_REMOVE", "f.txt"),
    ]
    assert all("entry" not in e for e in events[2:])  # a removal carries no entry (envd's opCarriesEntry)
    assert any(m == {"keepalive": {}} for m in seen)
    missing = wl.collect("filesystem.Filesystem/WatchDir", {"path": str(tmp_path / "none")})
    assert missing.error is not None and missing.error["code"] == "not_found"


def test_metrics_are_envds_sample_and_the_guests_series_with_its_pci_view(wl: WorkloadClient) -> None:
    r = wl.http.get("/metrics", headers=wl.headers())
    assert r.status_code == 200
    sample = r.json()
    assert sample["cpu_count"] >= 1 and 0 < sample["mem_used"] <= sample["mem_total"]
    assert 0 < sample["disk_used"] <= sample["disk_total"] and abs(sample["ts"] - time.time()) < 30
    series = wl.http.get("/cubeaccel/metrics", headers=wl.headers()).json()
    assert series["samples"] and series["samples"][-1]["ts"] >= sample["ts"] - 5
    assert isinstance(series["devices"], list)
    for path in ("/metrics", "/cubeaccel/metrics"):  # the token is required, as envd's /metrics
        assert wl.http.get(path, headers=wl.headers(token="wrong")).status_code == 401


def test_the_sampler_keeps_a_bounded_series_with_cpu_over_each_interval() -> None:
    from cubeaccel.workload.metrics import Sampler

    sampler = Sampler(interval_s=0.02, keep=5)
    try:
        wait_until(lambda: len(sampler.series()) == 5, what="five samples")
        end = time.monotonic() + 1
        while time.monotonic() < end:  # busy: the next samples see CPU use
            pass
        series = sampler.series()
        assert len(series) == 5 and all(0.0 <= s.cpu_used_pct <= 100.0 for s in series)
        assert any(s.cpu_used_pct > 0 for s in series)
    finally:
        sampler.stop()


def test_a_subdirectory_renamed_inside_a_recursive_watch_reports_under_its_new_name(tmp_path: Path) -> None:
    """inotify keeps one watch per inode: re-adding the moved directory returns its descriptor, so the
    watcher re-keys it (and what is below it) to the new path; later events name `c/b/x`, never `a/b/x`."""
    from cubeaccel.workload.watch import Watcher

    (tmp_path / "a" / "b").mkdir(parents=True)
    w = Watcher(path=str(tmp_path), recursive=True, include_entry=False)
    try:
        seen: list[tuple[str, str]] = []

        def has(wanted: tuple[str, str]) -> bool:
            seen.extend((e.type, e.name) for e in w.take(0.2))
            return wanted in seen

        (tmp_path / "a").rename(tmp_path / "c")
        wait_until(lambda: has(("EVENT_TYPE_CREATE", "c/b")), what="the moved tree")
        (tmp_path / "c" / "b" / "x").write_text("hi")
        wait_until(lambda: has(("EVENT_TYPE_WRITE", "c/b/x")), what="the write under its new name")
        assert ("EVENT_TYPE_RENAME", "a") in seen and not [n for _, n in seen if n.startswith("a/")], seen
    finally:
        w.close()
