"""What both workload benchmarks measure (through a real MicroVM, or the proxy alone): `/bin/true` exec times
and upload/download rates, summarised as min / median / max over runs."""

from __future__ import annotations

import io
import os
import statistics
import time
from collections.abc import Callable

from cubeaccel.transport.workload_client import WorkloadClient

MiB = 1 << 20


def exec_times(wl: WorkloadClient, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        assert wl.exec(["/bin/true"]).exit_code == 0
        out.append(time.perf_counter() - t0)
    return sorted(out)


def pct(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, round(p * (len(xs) - 1)))]


def file_rates(wl: WorkloadClient, mib: int, path: str, remove: Callable[[str], object]) -> tuple[float, float]:
    """MiB/s up and down for one `mib` file at `path` (checked byte for byte), then `remove(path)`."""
    blob = os.urandom(mib * MiB)
    t0 = time.perf_counter()
    wl.upload(path, io.BytesIO(blob))
    up = mib / (time.perf_counter() - t0)
    sink = io.BytesIO()
    t0 = time.perf_counter()
    wl.download(path, sink)
    down = mib / (time.perf_counter() - t0)
    assert sink.getvalue() == blob
    remove(path)
    return up, down


def summary(xs: list[float]) -> dict[str, float]:
    return {"min": round(min(xs), 2), "median": round(statistics.median(xs), 2), "max": round(max(xs), 2)}


def measure(
    wl: WorkloadClient, n: int, mib: int, runs: int, path: str, remove: Callable[[str], object], warm: int
) -> dict[str, dict[str, float]]:
    """`warm` execs, then `runs` rounds of `n` execs and one file each way: min / median / max per figure."""
    exec_times(wl, warm)
    p50s, p99s, ups, downs = [], [], [], []
    for _ in range(runs):
        ts = exec_times(wl, n)
        p50s.append(pct(ts, 0.5) * 1000)
        p99s.append(pct(ts, 0.99) * 1000)
        up, down = file_rates(wl, mib, path, remove)
        ups.append(up)
        downs.append(down)
    return {
        "exec_true_p50_ms": summary(p50s),
        "exec_true_p99_ms": summary(p99s),
        f"upload_{mib}MiB_MiBps": summary(ups),
        f"download_{mib}MiB_MiBps": summary(downs),
    }
