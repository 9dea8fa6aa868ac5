"""Reserve p99 beside `GET /v1/health` p99, 16 concurrent clients each, same Cubelet process, same run.

A real `cubeaccel cubelet serve` (simulated host) on its unix socket. Each run alternates rounds of 16 clients
calling `GET /v1/health` and rounds of 16 clients doing reserve → release, so both see the same machine; the
ratio reserve p99 ÷ health p99 is what the web stack adds on top of the bare route (aim ≤ 2), and the
server's own CPU per request (from /proc/PID/stat) is the figure least moved by other load.

Clients: `BENCH_CLIENT=raw` (default): 16 keep-alive HTTP/1.1 connections driven by one asyncio loop (little
client CPU, no client thread queued on the GIL, so the latency is the server's); `httpx`: `CubeletClient`, as
the CLI and CubeMaster call it, one thread each.
Run: `.venv/bin/python bench/http_bench.py` (BENCH_RUNS, BENCH_ROUNDS, BENCH_PER_CLIENT, BENCH_CLIENT).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from store_bench import cubelet_process

from cubeaccel.transport.cubelet_client import CubeletClient

CLIENTS = 16
TICKS = os.sysconf("SC_CLK_TCK")


class AsyncRawClient:
    """One keep-alive HTTP/1.1 connection on the unix socket, driven from one event loop with the others: no
    client thread waits on the GIL behind fifteen others (a threaded Python client's p99 is mostly that)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._r, self._w = reader, writer

    @classmethod
    async def open(cls, sock: Path) -> AsyncRawClient:
        return cls(*await asyncio.open_unix_connection(str(sock)))

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        data = b"" if body is None else json.dumps(body).encode()
        head = f"{method} {path} HTTP/1.1\r\nhost: cubelet\r\ncontent-length: {len(data)}\r\n"
        if data:
            head += "content-type: application/json\r\n"
        self._w.write(head.encode() + b"\r\n" + data)
        lines = (await self._r.readuntil(b"\r\n\r\n")).split(b"\r\n")
        status = int(lines[0].split()[1])
        length = next(int(v) for k, _, v in (x.partition(b":") for x in lines[1:]) if k.lower() == b"content-length")
        raw = await self._r.readexactly(length)
        if status >= 400:
            raise RuntimeError(f"{method} {path}: {status} {raw[:200]!r}")
        return json.loads(raw)

    async def health(self) -> Any:
        return await self.call("GET", "/v1/health")

    async def reserve(self, sandbox_id: str, count: int = 1) -> Any:
        return await self.call("POST", "/v1/reservations", {"sandbox_id": sandbox_id, "count": count})

    async def release(self, sandbox_id: str) -> Any:
        return await self.call("DELETE", f"/v1/reservations/{sandbox_id}")

    def close(self) -> None:
        self._w.close()


class ThreadedClient:
    """`CubeletClient` (httpx, as the CLI and CubeMaster call the Cubelet) in a thread per client."""

    def __init__(self, sock: Path) -> None:
        self._c = CubeletClient(socket=sock)

    async def health(self) -> Any:
        return await asyncio.to_thread(self._c.health)

    async def reserve(self, sandbox_id: str, count: int = 1) -> Any:
        return await asyncio.to_thread(self._c.reserve, sandbox_id, count)

    async def release(self, sandbox_id: str) -> Any:
        return await asyncio.to_thread(self._c.release, sandbox_id)

    def close(self) -> None:
        self._c.close()


def cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of the process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICKS, int(fields[12]) / TICKS


async def timed_health(c: Any) -> float:
    t0 = time.perf_counter()
    await c.health()
    return time.perf_counter() - t0


async def timed_pair(c: Any, sandbox_id: str) -> float:
    """Reserve then release `sandbox_id`; the reserve's latency."""
    t0 = time.perf_counter()
    await c.reserve(sandbox_id, 1)
    dt = time.perf_counter() - t0
    await c.release(sandbox_id)
    return dt


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[int(0.99 * (len(s) - 1))]


async def clients_round(clients: list[Any], body: Callable[[Any, int, int], Awaitable[float]], n: int) -> list[float]:
    """Each client runs `body(client, w, i)` n times, one after another; all clients at once."""

    async def one(w: int) -> list[float]:
        return [await body(clients[w], w, i) for i in range(n)]

    return [dt for lat in await asyncio.gather(*(one(w) for w in range(len(clients)))) for dt in lat]


async def measure(sock: Path, pid: int, rounds: int, per_client: int, kind: str) -> dict[str, Any]:
    if kind == "raw":
        clients: list[Any] = [await AsyncRawClient.open(sock) for _ in range(CLIENTS)]
    else:
        clients = [ThreadedClient(sock) for _ in range(CLIENTS)]
    seq = iter(range(1 << 30))

    async def health(c: Any, w: int, i: int) -> float:
        return await timed_health(c)

    async def pair(c: Any, w: int, i: int) -> float:
        return await timed_pair(c, f"b{w}-{next(seq)}")

    await clients_round(clients, health, 5)  # warm-up: connections open, routes compiled, pages touched
    await clients_round(clients, pair, 2)
    h_lat: list[float] = []
    r_lat: list[float] = []
    h_cpu = [0.0, 0.0]
    r_cpu = [0.0, 0.0]
    for _ in range(rounds):
        c0 = cpu_s(pid)
        h_lat += await clients_round(clients, health, per_client)
        c1 = cpu_s(pid)
        r_lat += await clients_round(clients, pair, per_client)
        c2 = cpu_s(pid)
        for k in (0, 1):
            h_cpu[k] += c1[k] - c0[k]
            r_cpu[k] += c2[k] - c1[k]
    for c in clients:
        c.close()
    n = rounds * per_client * CLIENTS
    return {
        "health_p50_ms": 1000 * statistics.median(h_lat),
        "health_p99_ms": 1000 * p99(h_lat),
        "reserve_p50_ms": 1000 * statistics.median(r_lat),
        "reserve_p99_ms": 1000 * p99(r_lat),
        "p99_ratio": p99(r_lat) / p99(h_lat),
        "server_cpu_ms_per_health": 1000 * sum(h_cpu) / n,
        "server_cpu_ms_per_pair": 1000 * sum(r_cpu) / n,
        "server_sys_ms_per_health": 1000 * h_cpu[1] / n,
        "server_sys_ms_per_pair": 1000 * r_cpu[1] / n,
        "n": n,
    }


def one_run(dir: Path, rounds: int, per_client: int, kind: str) -> dict[str, Any]:
    with cubelet_process(dir, 2 * CLIENTS) as (sock, pid):
        return asyncio.run(measure(sock, pid, rounds, per_client, kind))


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
    keys = ("health_p99_ms", "reserve_p50_ms", "reserve_p99_ms", "p99_ratio", "server_cpu_ms_per_health")
    for key in (*keys, "server_cpu_ms_per_pair", "server_sys_ms_per_health", "server_sys_ms_per_pair"):
        xs = [r[key] for r in rows]
        print(f"{key:<26} min {min(xs):8.3f}  median {statistics.median(xs):8.3f}  max {max(xs):8.3f}")
    print("aim: p99_ratio ≤ 2 and reserve p99 < 10 ms on an idle machine")


if __name__ == "__main__":
    main()
