"""Two trees' Cubelets side by side: the same kinds of load alternated between them round by round, so each
round's ratio (tree B ÷ tree A) is taken on the same machine at the same moment — the figure least moved by
other load on a shared machine.

Each server is a real `cubeaccel cubelet serve` (simulated host, 32 devices) run with that tree's `src` on its
PYTHONPATH. Per round and tree: `N` sequential health requests, audited refused reserves and reserve+release
pairs on one connection (server CPU per request from /proc/PID/stat), then 16 clients doing 10 pairs each
and 16 doing 10 health requests each (CPU per pair, reserve p99, health p99).
Run: `.venv/bin/python bench/http_ab_bench.py TREE_A TREE_B` (ROUNDS, N).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from http_bench import AsyncRawClient, clients_round, cpu_s, p99, timed_health, timed_pair

from cubeaccel.host.pci.simulated import SimulatedPciHost
from cubeaccel.transport.cubelet_client import CubeletClient

FIGURES = ("health", "refused", "pair", "pair16", "p99_16", "hp99_16")


def start(tree: Path, d: Path) -> subprocess.Popen[bytes]:
    SimulatedPciHost("h100x32", d / "simulated-host.json")
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    argv = [sys.executable, "-m", "cubeaccel", "cubelet", "serve", "--backend", "simulated"]
    argv += ["--profile", "h100x32", "--state-dir", str(d), "--tick", "60"]
    p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 30
    while True:
        try:
            c = CubeletClient(socket=d / "cubelet.sock")
            c.health()
            c.close()
            return p
        except Exception:
            if time.monotonic() > end:
                p.kill()
                raise
            time.sleep(0.05)


async def measure(dirs: list[Path], pids: list[int], rounds: int, n: int) -> dict[tuple[str, int], list[float]]:
    one = [await AsyncRawClient.open(d / "cubelet.sock") for d in dirs]
    many = [[await AsyncRawClient.open(d / "cubelet.sock") for _ in range(16)] for d in dirs]
    seq = iter(range(1 << 30))

    async def pair(c: Any, w: int = 0, i: int = 0) -> float:
        return await timed_pair(c, f"p{next(seq)}")

    async def refused(c: Any, w: int = 0, i: int = 0) -> float:
        with contextlib.suppress(RuntimeError):  # refused, as meant: not enough devices
            await c.call("POST", "/v1/reservations", {"sandbox_id": f"r{next(seq)}", "count": 99})
        return 0.0

    async def health(c: Any, w: int = 0, i: int = 0) -> float:
        return await timed_health(c)

    res: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for k, pid in enumerate(pids):
            for name, fn in (("health", health), ("refused", refused), ("pair", pair)):
                u0 = cpu_s(pid)
                for _ in range(n):
                    await fn(one[k])
                u1 = cpu_s(pid)
                res.setdefault((name, k), []).append(1000 * (sum(u1) - sum(u0)) / n)
            u0 = cpu_s(pid)
            lat = await clients_round(many[k], pair, 10)
            u1 = cpu_s(pid)
            res.setdefault(("pair16", k), []).append(1000 * (sum(u1) - sum(u0)) / len(lat))
            res.setdefault(("p99_16", k), []).append(1000 * p99(lat))
            res.setdefault(("hp99_16", k), []).append(1000 * p99(await clients_round(many[k], health, 10)))
    for c in [*one, *(c for cs in many for c in cs)]:
        c.close()
    return res


def main() -> None:
    trees = [Path(t).resolve() for t in sys.argv[1:3]]
    if len(trees) != 2:
        raise SystemExit("usage: http_ab_bench.py TREE_A TREE_B")
    rounds, n = int(os.environ.get("ROUNDS", "5")), int(os.environ.get("N", "150"))
    print("load before", Path("/proc/loadavg").read_text().split()[:3])
    with tempfile.TemporaryDirectory() as d0:
        dirs = [Path(d0) / "a", Path(d0) / "b"]
        for d in dirs:
            d.mkdir()
        procs = [start(t, d) for t, d in zip(trees, dirs, strict=True)]
        try:
            res = asyncio.run(measure(dirs, [p.pid for p in procs], rounds, n))
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
    print("ms (CPU per request, or p99); min / median / max over rounds; B/A per round")
    for name in FIGURES:
        a, b = res[(name, 0)], res[(name, 1)]
        r = sorted(y / x if x else float("inf") for x, y in zip(a, b, strict=True))  # inf: A under one clock tick
        print(
            f"{name:8s} A {min(a):6.2f}/{statistics.median(a):6.2f}/{max(a):6.2f}"
            f"  B {min(b):6.2f}/{statistics.median(b):6.2f}/{max(b):6.2f}"
            f"  B/A {r[0]:.2f}/{statistics.median(r):.2f}/{r[-1]:.2f}"
        )
    print("load after", Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    main()
