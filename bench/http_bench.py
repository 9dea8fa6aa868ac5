"""Reserve p99 beside `GET /v1/health` p99, 16 concurrent clients each, same Cubelet process, same run.

A real `cubeaccel cubelet serve` (simulated host) on its unix socket. Each run alternates rounds of 16 clients
calling `GET /v1/health` and rounds of 16 clients doing reserve → release, so both see the same machine; the
ratio reserve p99 ÷ health p99 is what the web stack adds on top of the bare route (aim ≤ 2), and the
server's own CPU per request (from /proc/PID/stat) is the figure least moved by other load.

Clients: `BENCH_CLIENT=raw` (default) is a keep-alive HTTP/1.1 client on `http.client` (little client CPU, so
the two cores are mostly the server's); `httpx` is `CubeletClient`, as the CLI and CubeMaster call it.
Run: `.venv/bin/python bench/http_bench.py` (BENCH_RUNS, BENCH_ROUNDS, BENCH_PER_CLIENT, BENCH_CLIENT).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from store_bench import cubelet_process

from cubeaccel.wire.cubelet_client import CubeletClient

CLIENTS = 16
TICKS = os.sysconf("SC_CLK_TCK")


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("cubelet")
        self._path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self._path)


class RawClient:
    """Just enough of the Cubelet API: one keep-alive connection, JSON in and out, errors raised."""

    def __init__(self, sock: Path) -> None:
        self._conn = UnixHTTPConnection(sock)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {} if data is None else {"content-type": "application/json"}
        self._conn.request(method, path, body=data, headers=headers)
        reply = self._conn.getresponse()
        raw = reply.read()
        if reply.status >= 400:
            raise RuntimeError(f"{method} {path}: {reply.status} {raw[:200]!r}")
        return json.loads(raw)

    def health(self) -> Any:
        return self._call("GET", "/v1/health")

    def reserve(self, sandbox_id: str, count: int = 1) -> Any:
        return self._call("POST", "/v1/reservations", {"sandbox_id": sandbox_id, "count": count})

    def release(self, sandbox_id: str) -> Any:
        return self._call("DELETE", f"/v1/reservations/{sandbox_id}")

    def close(self) -> None:
        self._conn.close()


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[int(0.99 * (len(s) - 1))]


def clients_round(clients: list[Any], body: Callable[[Any, int, int], float | None], n: int) -> list[float]:
    """Each client runs `body(client, w, i)` n times in its own thread, all started together."""
    lat: list[float] = []
    lock = threading.Lock()
    start = threading.Barrier(len(clients))

    def worker(w: int) -> None:
        start.wait()
        mine = [dt for i in range(n) if (dt := body(clients[w], w, i)) is not None]
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat


def one_run(dir: Path, rounds: int, per_client: int, kind: str) -> dict[str, Any]:
    with cubelet_process(dir, 2 * CLIENTS) as (sock, pid):
        make = RawClient if kind == "raw" else (lambda s: CubeletClient(socket=s))
        clients = [make(sock) for _ in range(CLIENTS)]
        seq = iter(range(1 << 30))

        def health(c: Any, w: int, i: int) -> float:
            t0 = time.perf_counter()
            c.health()
            return time.perf_counter() - t0

        def pair(c: Any, w: int, i: int) -> float:
            sid = f"b{w}-{next(seq)}"
            t0 = time.perf_counter()
            c.reserve(sid, 1)
            dt = time.perf_counter() - t0
            c.release(sid)
            return dt

        clients_round(clients, health, 5)  # warm-up: connections open, routes compiled, pages touched
        clients_round(clients, pair, 2)
        h_lat: list[float] = []
        r_lat: list[float] = []
        h_cpu = r_cpu = 0.0
        for _ in range(rounds):
            c0 = cpu_s(pid)
            h_lat += clients_round(clients, health, per_client)
            c1 = cpu_s(pid)
            r_lat += clients_round(clients, pair, per_client)
            c2 = cpu_s(pid)
            h_cpu, r_cpu = h_cpu + c1 - c0, r_cpu + c2 - c1
        for c in clients:
            c.close()
    n = rounds * per_client * CLIENTS
    return {
        "health_p50_ms": 1000 * statistics.median(h_lat),
        "health_p99_ms": 1000 * p99(h_lat),
        "reserve_p50_ms": 1000 * statistics.median(r_lat),
        "reserve_p99_ms": 1000 * p99(r_lat),
        "p99_ratio": p99(r_lat) / p99(h_lat),
        "server_cpu_ms_per_health": 1000 * h_cpu / n,
        "server_cpu_ms_per_pair": 1000 * r_cpu / n,
        "n": n,
    }


def main() -> None:
    runs = int(os.environ.get("BENCH_RUNS", "3"))
    rounds = int(os.environ.get("BENCH_ROUNDS", "3"))
    per_client = int(os.environ.get("BENCH_PER_CLIENT", "20"))
    kind = os.environ.get("BENCH_CLIENT", "raw")
    rows = []
    for i in range(runs):
        load0 = Path("/proc/loadavg").read_text().split()[:3]
        with tempfile.TemporaryDirectory() as d:
            row = one_run(Path(d), rounds, per_client, kind)
        row = {"run": i, "client": kind, "loadavg_before": load0, **{k: round(v, 3) for k, v in row.items()}}
        row["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
        rows.append(row)
        print(json.dumps(row), flush=True)
    for key in ("health_p99_ms", "reserve_p99_ms", "p99_ratio", "server_cpu_ms_per_health", "server_cpu_ms_per_pair"):
        xs = [r[key] for r in rows]
        print(f"{key:<26} min {min(xs):8.3f}  median {statistics.median(xs):8.3f}  max {max(xs):8.3f}")
    print("aim: p99_ratio ≤ 2 and reserve p99 < 10 ms on an idle machine")


if __name__ == "__main__":
    main()
