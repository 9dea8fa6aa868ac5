"""A reconcile pass after a restart with many simulated devices (default 1,000 H100s, in-memory host).

First start: register and validate every device. Then a "restart" (a new Store and Cubelet over the same
database and hardware) and one timed `reconcile` pass, as the Cubelet runs at startup and on every tick.
Prints one JSON line per run and min/median/max. Aim: pass < 0.5 s at 1,000 devices.
Run: `.venv/bin/python bench/reconcile_bench.py` (BENCH_DEVICES, BENCH_RUNS).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.cubelet.inventory import initialize_host
from cubeaccel.cubelet.lifecycle import Cubelet
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.cubelet.runtime import assemble
from cubeaccel.cubelet.shim_driver import SimulatedShimDriver
from cubeaccel.cubelet.store import Store
from cubeaccel.host.pci.simulated import SimulatedPciHost
from cubeaccel.model.device import PciAddress


def big_host(n: int) -> SimulatedPciHost:
    """`n` H100s at distinct addresses (the profile parser stops at 64: a guard for CLI input, not a model)."""
    host = SimulatedPciHost("h100")
    template: dict[str, Any] = next(iter(host._s["functions"].values()))
    funcs = {}
    for i in range(n):
        addr = str(PciAddress(i // 200, 0x10 + i % 200, 0, 0))
        funcs[addr] = {**template, "iommu_group": 20 + i, "serial": f"SIM-H100-{i:05d}", "numa_node": i % 2}
    host._s["functions"] = funcs
    return host


def one_run(n: int) -> dict[str, float]:
    host = big_host(n)
    with tempfile.TemporaryDirectory() as d:
        db = Path(d) / "cubelet.db"

        def build() -> Cubelet:
            return assemble(Store(db), VfioBackend(host, allow=("10de:*",)), SimulatedShimDriver(host))

        t0 = time.perf_counter()
        first = build()
        initialize_host(first)
        first_start = time.perf_counter() - t0
        first.store.close()
        again = build()  # the restart: same database, same hardware
        t1 = time.perf_counter()
        initialize_host(again)
        init_after_restart = time.perf_counter() - t1
        t2 = time.perf_counter()
        repairs = reconcile(again)
        pass_s = time.perf_counter() - t2
        allocatable = sum(1 for x in again.store.devices() if x.state.value == "allocatable")
        again.store.close()
    return {
        "devices": n,
        "allocatable": allocatable,
        "repairs": len(repairs),
        "first_start_s": round(first_start, 3),
        "init_after_restart_s": round(init_after_restart, 3),
        "reconcile_pass_s": round(pass_s, 3),
    }


def main() -> None:
    n = int(os.environ.get("BENCH_DEVICES", "1000"))
    runs = int(os.environ.get("BENCH_RUNS", "3"))
    passes = []
    for i in range(runs):
        r = one_run(n)
        r["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]  # type: ignore[assignment]
        passes.append(r["reconcile_pass_s"])
        print(json.dumps({"run": i, **r}), flush=True)
    print(
        f"reconcile pass after restart, {n} devices, {runs} runs: min {min(passes):.3f} s, "
        f"median {statistics.median(passes):.3f} s, max {max(passes):.3f} s (aim < 0.5 s)"
    )


if __name__ == "__main__":
    main()
