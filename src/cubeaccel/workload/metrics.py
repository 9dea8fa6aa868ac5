"""The guest's own resource samples, envd's `GET /metrics` shape, taken every 5 s and kept for an hour.

E2B's orchestrator polls envd's `/metrics` and keeps the series; here nothing outside the guest holds the
sandbox's token (the Cubelet keeps only its hash, the front door is stateless), so the guest keeps its own
series and `GET /cubeaccel/metrics` hands it out whole, with the PCI devices the guest sees (what it reports
of its hot-plugged accelerators). Values as gopsutil computes them for envd: used memory = MemTotal -
MemAvailable, CPU % over the interval since the previous sample, disk = statvfs("/") total - available.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque

from cubeaccel.protocol.guest_metrics import MetricsSample, PciFunction

INTERVAL_S = 5.0
KEEP = 720  # one hour of samples
PCI = "/sys/bus/pci/devices"
VIRTIO_VENDOR = "0x1af4"


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat (iowait and idle are idle, as gopsutil's Percent)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])  # guest and guest_nice are inside user and nice already
    return total - idle, total


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[name] = int(parts[0]) * 1024
    return out


def pci_devices() -> list[PciFunction]:
    """Every PCI function the guest sees but its own plumbing (virtio, bridges): address, ids, class, driver."""
    found: list[PciFunction] = []
    with contextlib.suppress(OSError):
        for address in sorted(os.listdir(PCI)):
            base = os.path.join(PCI, address)

            def read(name: str, base: str = base) -> str:
                try:
                    with open(os.path.join(base, name)) as f:
                        return f.read().strip()
                except OSError:
                    return ""

            vendor, pci_class = read("vendor"), read("class")
            if vendor == VIRTIO_VENDOR or pci_class.startswith("0x06"):
                continue
            driver = (
                os.path.basename(os.readlink(os.path.join(base, "driver")))
                if os.path.islink(os.path.join(base, "driver"))
                else ""
            )
            found.append(PciFunction(address, vendor, read("device"), pci_class, driver))
    return found


class Sampler:
    """A daemon thread sampling every `interval_s` into a bounded ring."""

    def __init__(self, interval_s: float = INTERVAL_S, keep: int = KEEP) -> None:
        self.interval_s = interval_s
        self._samples: deque[MetricsSample] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._last_cpu: tuple[int, int] | None = None
        self._stop = threading.Event()
        self.sample()
        threading.Thread(target=self._run, daemon=True, name="metrics").start()

    def sample(self) -> MetricsSample:
        busy, total = _cpu_times()
        pct = 0.0
        if self._last_cpu is not None and total > self._last_cpu[1]:
            pct = round(100.0 * (busy - self._last_cpu[0]) / (total - self._last_cpu[1]), 2)
        self._last_cpu = (busy, total)
        mem = _meminfo()
        mem_total = mem.get("MemTotal", 0)
        mem_used = mem_total - mem.get("MemAvailable", mem.get("MemFree", 0))
        st = os.statvfs("/")
        disk_total, disk_free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        sample = MetricsSample(
            ts=int(time.time()),
            cpu_count=os.cpu_count() or 1,
            cpu_used_pct=max(0.0, pct),
            mem_total_mib=mem_total // (1 << 20),
            mem_used_mib=mem_used // (1 << 20),
            mem_total=mem_total,
            mem_used=mem_used,
            mem_cache=mem.get("Cached", 0),
            disk_used=disk_total - disk_free,
            disk_total=disk_total,
        )
        with self._lock:
            self._samples.append(sample)
        return sample

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(OSError, ValueError, IndexError):
                self.sample()

    def latest(self) -> MetricsSample:
        with self._lock:
            return self._samples[-1]

    def series(self) -> tuple[MetricsSample, ...]:
        with self._lock:
            return tuple(self._samples)

    def stop(self) -> None:
        self._stop.set()
