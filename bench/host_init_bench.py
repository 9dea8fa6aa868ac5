"""Host initialization on a fake sysfs tree read through the real sysfs code (default 1,000 GPUs), and a real
`cubeaccel cubelet serve --backend vfio` process over an 8-GPU tree started, SIGKILLed and started again.

In process, per run: a first start (half the GPUs bound to nvidia, so it binds them to vfio-pci, then validates
every GPU), a restart (a new Store and Cubelet over the same journal and tree) and one reconcile pass; each is
timed (wall clock and, for the first start, this process's CPU time) and the host's function listings are
counted. Aim: first start of 1,000 GPUs ≤ 5 s.
Process, per run: seconds from launch until the Cubelet answers with every GPU allocatable, first start and
after SIGKILL; `restart_adds_s` is the second minus the first. Aim: < 1 s.
Prints one JSON line per run and min/median/max, with the load average.
Run: `PYTHONPATH=src:. .venv/bin/python bench/host_init_bench.py` (BENCH_DEVICES, BENCH_RUNS; BENCH_PROCESS=0 skips
the process).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from tests.support.cubelet_process import CubeletProcess
from tests.support.fake_sysfs import Dev, FakeSysfs
from tests.support.holder_proc import unreadable_pids
from tests.support.poll import poll

from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.cubelet.inventory import initialize_host
from cubeaccel.cubelet.lifecycle import Cubelet, CubeletConfig
from cubeaccel.cubelet.process_shim import ProcessShimDriver
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.cubelet.runtime import assemble
from cubeaccel.cubelet.store import Store
from cubeaccel.host.pci.base import PciFunction
from cubeaccel.host.pci.readiness import HostRoots
from cubeaccel.host.pci.sysfs import SysfsPciHost


class ListingCounter(SysfsPciHost):
    listings = 0

    def functions(self) -> list[PciFunction]:
        self.listings += 1
        return super().functions()


def gpus(n: int, bound: str | None = None) -> list[Dev]:
    """`n` H100s, each in its own IOMMU group; `bound` None: every other one on nvidia, the rest on vfio-pci."""
    return [
        Dev(
            f"0000:{0x10 + i // 32:02x}:{i % 32:02x}.0",
            iommu_group=10 + i,
            driver=bound or ("nvidia" if i % 2 else "vfio-pci"),
            serial=0x1000 + i,
            numa_node=i % 2,
        )
        for i in range(n)
    ]


def in_process(n: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        fake = FakeSysfs.build(tmp / "fake", gpus(n))

        def build() -> tuple[Cubelet, ListingCounter]:
            host = ListingCounter(fake.sys, proc_root=fake.proc, dev_root=fake.dev, on_write=fake.kernel)
            roots = HostRoots(fake.sys, fake.dev, fake.proc)
            backend = VfioBackend(host, allow=("10de:*",), readiness_roots=roots)
            cfg = CubeletConfig(pinnable_memory_mib=4096)
            return assemble(Store(tmp / "cubelet.db"), backend, ProcessShimDriver(tmp / "run"), cfg), host

        first, host = build()
        t0, c0 = time.perf_counter(), time.process_time()
        initialize_host(first)
        first_s, first_cpu = time.perf_counter() - t0, time.process_time() - c0
        first_listings = host.listings
        allocatable = sum(1 for x in first.store.devices() if x.state.value == "allocatable")
        first.store.close()
        again, host = build()
        t1 = time.perf_counter()
        initialize_host(again)
        restart_s = time.perf_counter() - t1
        restart_listings, host.listings = host.listings, 0
        t2 = time.perf_counter()
        repairs = reconcile(again)
        pass_s = time.perf_counter() - t2
        again.store.close()
    return {
        "devices": n,
        "allocatable": allocatable,
        "first_start_s": round(first_s, 3),
        "first_start_cpu_s": round(first_cpu, 3),  # this process's CPU: what the load on the machine does not add
        "first_start_listings": first_listings,
        "restart_init_s": round(restart_s, 3),
        "restart_listings": restart_listings,
        "reconcile_pass_s": round(pass_s, 3),
        "reconcile_listings": host.listings,
        "repairs": len(repairs),
    }


def _ready(p: CubeletProcess, n: int) -> bool:
    try:
        return sum(1 for d in p.client.devices() if d.state == "allocatable") == n
    except Exception:
        return False


def _start(p: CubeletProcess, n: int) -> float:
    t0 = time.perf_counter()
    p.start()
    poll(lambda: _ready(p, n), deadline_s=120)
    return time.perf_counter() - t0


def process(n: int = 8) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        # the tree's "kernel" is this process, so the Cubelet's writes would not take: its GPUs start on vfio-pci
        fake = FakeSysfs.build(tmp / "fake", gpus(n, bound="vfio-pci"))
        state = tmp / "state"
        state.mkdir()
        roots = ["--sysfs-root", str(fake.sys), "--dev-root", str(fake.dev), "--proc-root", str(fake.proc)]
        exempt = [f"--holder-scan-exempt-pid={pid}" for pid in unreadable_pids()]
        # gpu=none: what is timed is host init, not whether this machine's cache holds an NVIDIA scrub image
        p = CubeletProcess(state, "-", "--backend", "vfio", "--allow", "10de:*", "--scrub", "gpu=none", *roots, *exempt)
        try:
            first = _start(p, n)
            p.sigkill()
            again = _start(p, n)
        finally:
            p.stop()
    return {
        "gpus": n,
        "first_start_s": round(first, 3),
        "after_sigkill_s": round(again, 3),
        "restart_adds_s": round(again - first, 3),
    }


def _summary(name: str, values: list[float]) -> None:
    print(f"{name}: min {min(values):.3f} median {statistics.median(values):.3f} max {max(values):.3f}")


def main() -> None:
    n = int(os.environ.get("BENCH_DEVICES", "1000"))
    runs = int(os.environ.get("BENCH_RUNS", "3"))
    rows = []
    for _ in range(runs):
        r = in_process(n)
        r["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
        print(json.dumps(r))
        rows.append(r)
    for key in ("first_start_s", "first_start_cpu_s", "restart_init_s", "reconcile_pass_s"):
        _summary(f"{key} ({n} GPUs)", [float(str(r[key])) for r in rows])
    if os.environ.get("BENCH_PROCESS", "1") == "0":
        return
    procs = []
    for _ in range(runs):
        r = process()
        r["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
        print(json.dumps(r))
        procs.append(r)
    for key in ("first_start_s", "after_sigkill_s", "restart_adds_s"):
        _summary(f"process {key} (8 GPUs)", [float(str(r[key])) for r in procs])


if __name__ == "__main__":
    main()
