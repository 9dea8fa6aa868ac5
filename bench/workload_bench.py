"""cube-workload on this machine, without a VM: exec round trip and file MiB/s, over TCP loopback and over the mux
framing on a socketpair (what virtio-serial will carry), side by side in the same run.

What is timed: exec = one `process.Process/Start` of `/bin/true` (and of `/bin/bash -l -c true`, what the E2B SDK
sends) from request to end-of-stream; files = one `POST /files` (octet-stream) and one `GET /files` (identity) of
a random file. Each figure is run 3 times; min/median/max over the runs are printed with /proc/loadavg, since
the machine is shared. The guest-side cost per call is the server's CPU time (utime+stime) per exec.

Run: `PYTHONPATH=src .venv/bin/python bench/workload_bench.py [--quick]`. Prints one JSON line and a table.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cubeaccel.workload.connect import EnvelopeDecoder, encode_envelope
from cubeaccel.workload.http1 import Connection, socket_connection
from cubeaccel.workload.muxchannel import MuxChannel

ROOT = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024


class _KeepOpen:
    """HTTPResponse closes its file at the end of a body; the connection is kept alive, so that close is ignored."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def close(self) -> None:
        pass


class _Sock:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def makefile(self, mode: str) -> Any:
        return _KeepOpen(self.conn.reader)


def request(conn: Connection, token: str, method: str, path: str, body: bytes, ctype: str) -> tuple[int, bytes]:
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: w\r\nX-Access-Token: {token}\r\nContent-Type: {ctype}\r\n"
        f"Accept-Encoding: identity\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    conn.writer.write(head.encode() + body)
    conn.writer.flush()
    resp = http.client.HTTPResponse(_Sock(conn))  # type: ignore[arg-type]
    resp.begin()
    return resp.status, resp.read()


def server_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench(dial: Callable[[], Connection], token: str, pid: int, quick: bool, tmp: Path) -> dict[str, Any]:
    conn = dial()  # one keep-alive connection (one mux stream), as an SDK's pool would reuse
    out: dict[str, Any] = {}
    for name, cmd in (("true", ["/bin/true"]), ("bash_l_true", ["/bin/bash", "-l", "-c", "true"])):
        body = encode_envelope({"process": {"cmd": cmd[0], "args": cmd[1:]}, "stdin": False})
        runs = []
        for _ in range(3):
            n = 10 if quick else (40 if name == "true" else 15)
            times = []
            cpu0 = server_cpu_s(pid)
            for _ in range(n):
                t = time.perf_counter()
                status, data = request(conn, token, "POST", "/process.Process/Start", body, "application/connect+json")
                times.append((time.perf_counter() - t) * 1000)
                assert status == 200 and b'"end"' in data, data[:200]
                EnvelopeDecoder().feed(data)
            times.sort()
            runs.append(
                {
                    "p50": statistics.median(times),
                    "p99": times[int(0.99 * (len(times) - 1))],
                    "server_cpu_ms": (server_cpu_s(pid) - cpu0) / n * 1000,
                }
            )
        out[f"exec_{name}_ms"] = {k: summary([r[k] for r in runs]) for k in runs[0]}
    size = (8 if quick else 32) * MiB
    blob = os.urandom(size)
    path = tmp / "bench.bin"
    up, down = [], []
    for _ in range(3):
        t = time.perf_counter()
        status, _ = request(conn, token, "POST", f"/files?path={path}", blob, "application/octet-stream")
        up.append(size / MiB / (time.perf_counter() - t))
        assert status == 200
        t = time.perf_counter()
        status, data = request(conn, token, "GET", f"/files?path={path}", b"", "application/octet-stream")
        down.append(size / MiB / (time.perf_counter() - t))
        assert status == 200 and data == blob
    out["upload_MiB_s"], out["download_MiB_s"], out["file_MiB"] = summary(up), summary(down), size // MiB
    conn.close()
    return out


def summary(values: list[float]) -> dict[str, float]:
    return {"min": round(min(values), 2), "median": round(statistics.median(values), 2), "max": round(max(values), 2)}


def start(tmp: Path, transport: list[str], pass_fds: tuple[int, ...] = ()) -> tuple[subprocess.Popen[bytes], str]:
    token = secrets.token_urlsafe(16)
    (tmp / "token").write_text(token)
    err = tmp / f"stderr-{transport[0]}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cubeaccel.workload", "serve", *transport, "--token-file", str(tmp / "token")],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        stderr=err.open("wb"),
        pass_fds=pass_fds,
    )
    deadline = time.monotonic() + 20
    while b"serving on" not in err.read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
        time.sleep(0.02)
    return proc, err.read_text()


def main() -> int:
    quick = "--quick" in sys.argv
    result: dict[str, Any] = {"loadavg_before": Path("/proc/loadavg").read_text().split()[:3]}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        proc, log = start(tmp, ["--tcp", "127.0.0.1:0"])
        port = int(log.strip().rsplit(":", 1)[1])
        try:
            result["tcp_loopback"] = bench(
                lambda: socket_connection(socket.create_connection(("127.0.0.1", port)), "bench"),
                (tmp / "token").read_text(),
                proc.pid,
                quick,
                tmp,
            )
        finally:
            proc.terminate()
            proc.wait(10)
        guest, host = socket.socketpair()
        proc, _ = start(tmp, ["--mux-fd", str(guest.fileno())], (guest.fileno(),))
        guest.close()
        channel = MuxChannel(host.fileno(), host.fileno(), client=True)
        try:
            result["mux_socketpair"] = bench(channel.open, (tmp / "token").read_text(), proc.pid, quick, tmp)
        finally:
            channel.close()
            host.close()
            proc.wait(10)
    result["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    print(json.dumps(result))
    for transport in ("tcp_loopback", "mux_socketpair"):
        r = result[transport]
        print(f"{transport}:")
        for key, value in r.items():
            print(f"  {key:22} {value}")
    print(f"loadavg before {result['loadavg_before']} after {result['loadavg_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
