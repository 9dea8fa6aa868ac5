"""Durable reserve+release cycles/s through Cubelet's store, beside raw fsync'd SQLite commits (same run),
and reserve latency over HTTP (unix socket) with 16 concurrent clients against a real Cubelet process.

Prints one JSON line and a readable table. Run: `make bench` or `.venv/bin/python bench/store_bench.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.cubelet.inventory import initialize_host
from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.runtime import assemble
from cubeaccel.cubelet.shim_driver import SimulatedShimDriver
from cubeaccel.cubelet.store import Store
from cubeaccel.host.pci.simulated import SimulatedPciHost
from cubeaccel.transport.cubelet_client import CubeletClient


def raw_commits_per_s(path: Path, seconds: float) -> tuple[float, int]:
    """Baseline: one-row UPDATE + INSERT per commit, WAL + synchronous=FULL, like our transitions."""
    c = sqlite3.connect(str(path), isolation_level=None)
    c.execute("PRAGMA journal_mode=WAL")
    c.execute("PRAGMA synchronous=FULL")
    c.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, state TEXT, gen INTEGER)")
    c.execute("CREATE TABLE e (seq INTEGER PRIMARY KEY AUTOINCREMENT, body TEXT)")
    c.execute("INSERT INTO t VALUES (1, 'a', 0)")
    n, end = 0, time.perf_counter() + seconds
    start = time.perf_counter()
    while time.perf_counter() < end:
        c.execute("BEGIN IMMEDIATE")
        c.execute("UPDATE t SET gen=gen+1 WHERE id=1 AND gen=?", (n,))
        c.execute("INSERT INTO e (body) VALUES ('x')")
        c.execute("COMMIT")
        n += 1
    rate = n / (time.perf_counter() - start)
    c.close()
    return rate, n


def store_cycles_per_s(dir: Path, seconds: float) -> tuple[float, int, float, float]:
    """Returns cycles/s, cycles, events per cycle and durable commits per cycle (one stream: no batching, so
    this is the number of decisions a cycle must make durable one after another)."""
    host = SimulatedPciHost("h100x8")  # in-memory hardware: we measure the store, not JSON files
    store = Store(dir / "cubelet.db")
    cubelet = assemble(store, VfioBackend(host, allow=("10de:*",)), SimulatedShimDriver(host))
    initialize_host(cubelet)
    commits0 = store.commits
    n, end = 0, time.perf_counter() + seconds
    start = time.perf_counter()
    seq0 = store.events()[-1].seq if store.events() else 0
    while time.perf_counter() < end:
        sid = f"b{n}"
        cubelet.reserve(sid, ReservationRequest(count=1))
        cubelet.release(sid)
        n += 1
    elapsed = time.perf_counter() - start
    events = len(store.events(seq0, 10**9))
    commits = store.commits - commits0
    store.close()
    return n / elapsed, n, events / max(n, 1), commits / max(n, 1)


def concurrent_cycles_per_s(dir: Path, seconds: float, threads: int = 16) -> tuple[float, int, float]:
    """`threads` callers doing reserve+release at once (one durable commit per decision).
    Returns cycles/s, cycles, and durable commits per cycle (nan where the store does not count them)."""
    host = SimulatedPciHost(f"h100x{2 * threads}")
    store = Store(dir / "cubelet-concurrent.db")
    cubelet = assemble(store, VfioBackend(host, allow=("10de:*",)), SimulatedShimDriver(host))
    initialize_host(cubelet)
    counts = [0] * threads
    commits0 = getattr(store, "commits", None)
    end = time.perf_counter() + seconds

    def worker(w: int) -> None:
        while time.perf_counter() < end:
            sid = f"c{w}-{counts[w]}"
            cubelet.reserve(sid, ReservationRequest(count=1))
            cubelet.release(sid)
            counts[w] += 1

    start = time.perf_counter()
    pool = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - start
    n = sum(counts)
    commits = getattr(store, "commits", None)
    per_cycle = float("nan") if commits0 is None or commits is None else (commits - commits0) / max(n, 1)
    store.close()
    return n / elapsed, n, per_cycle


@contextlib.contextmanager
def cubelet_process(dir: Path, devices: int, reset_delay_s: float = 0.0) -> Iterator[tuple[Path, int]]:
    """A real `cubeaccel cubelet serve` on a simulated host of `devices` H100s; yields (its socket, its pid)
    once it answers `GET /v1/health`. `reset_delay_s`: every device reset takes this long (a real FLR ≥ 100 ms)."""
    host = SimulatedPciHost(f"h100x{devices}", dir / "simulated-host.json")  # the file the server opens
    host.set_reset_delay(reset_delay_s)
    cmd = [
        sys.executable,
        "-m",
        "cubeaccel",
        "cubelet",
        "serve",
        "--backend",
        "simulated",
        "--profile",
        f"h100x{devices}",
        "--state-dir",
        str(dir),
        "--tick",
        "60",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sock = dir / "cubelet.sock"
    try:
        probe = CubeletClient(socket=sock)
        end = time.monotonic() + 30
        while True:
            try:
                probe.health()
                break
            except Exception:
                if time.monotonic() > end:
                    raise
                time.sleep(0.05)
        probe.close()
        yield sock, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def http_latency(dir: Path, clients: int, per_client: int, reset_delay_s: float = 0.0) -> dict[str, float]:
    """`reset_delay_s`: every device reset on the simulated host takes this long (a real FLR ≥ 100 ms)."""
    with cubelet_process(dir, 2 * clients, reset_delay_s) as (sock, _):
        lat: list[float] = []
        lock = threading.Lock()
        errors: list[str] = []

        def worker(w: int) -> None:
            c = CubeletClient(socket=sock)
            for i in range(per_client):
                t0 = time.perf_counter()
                try:
                    c.reserve(f"w{w}-{i}", 1)
                except Exception as e:
                    errors.append(str(e))
                    continue
                dt = time.perf_counter() - t0
                with lock:
                    lat.append(dt)
                c.release(f"w{w}-{i}")
            c.close()

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        lat.sort()
        return {
            "reserve_p50_ms": 1000 * statistics.median(lat),
            "reserve_p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))],
            "reserves": len(lat),
            "errors": len(errors),
            "reserve_release_pairs_per_s": len(lat) / wall,
        }


def main() -> None:
    seconds = float(os.environ.get("BENCH_SECONDS", "5"))
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        raw, raw_n = raw_commits_per_s(root / "raw.db", seconds)
        cyc, cyc_n, events_per_cycle, single_commits = store_cycles_per_s(root, seconds)
        ccyc, ccyc_n, commits_per_cycle = concurrent_cycles_per_s(root, seconds)
        (root / "http").mkdir()
        http = http_latency(root / "http", 16, int(os.environ.get("BENCH_PER_CLIENT", "40")))
    result = {
        "bench": "cubelet_store",
        "raw_fsync_commits_per_s": round(raw, 1),
        "reserve_release_cycles_per_s": round(cyc, 1),
        "ratio_cycles_to_raw_commits": round(cyc / raw, 3),
        "commits_per_cycle": round(single_commits, 2),
        "concurrent16_cycles_per_s": round(ccyc, 1),
        "ratio_concurrent16_cycles_to_raw_commits": round(ccyc / raw, 3),
        "concurrent16_commits_per_cycle": round(commits_per_cycle, 2),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "events_per_cycle": round(events_per_cycle, 1),
        **{k: round(v, 3) for k, v in http.items()},
        "cores": os.cpu_count(),
    }
    print(json.dumps(result))
    rows = [
        ("raw fsync'd SQLite commits/s (baseline)", f"{raw:,.0f}", f"n={raw_n}"),
        ("durable reserve+release cycles/s", f"{cyc:,.0f}", f"n={cyc_n}"),
        ("ratio cycles / raw commits", f"{cyc / raw:.3f}", f"single stream: ceiling {1 / single_commits:.2f}"),
        ("reserve+release cycles/s, 16 threads", f"{ccyc:,.0f}", f"n={ccyc_n}"),
        ("ratio 16-thread cycles / raw commits", f"{ccyc / raw:.3f}", "aim ≥ 0.5"),
        ("durable commits per cycle, 16 threads", f"{commits_per_cycle:.2f}", f"{single_commits:.2f} in one stream"),
        ("HTTP reserve p50 (16 clients)", f"{http['reserve_p50_ms']:.2f} ms", f"n={http['reserves']:.0f}"),
        ("HTTP reserve p99 (16 clients)", f"{http['reserve_p99_ms']:.2f} ms", "aim < 10 ms"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>12}  {note}")


if __name__ == "__main__":
    main()
