"""SimulatedPciHost: an in-memory kernel model with fault injection, optionally persisted to a file.

Persisting matters: a Cubelet killed with SIGKILL must find the same "hardware" (and the same
simulated VMM holders) when it restarts, exactly as a real host keeps its devices across a
Cubelet restart. Other processes (tests) inject faults by opening the same file.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from cubeaccel.host.pci.base import Holder, PciFunction, host_error
from cubeaccel.model.bars import Bar, BarKind
from cubeaccel.model.device import PciAddress
from cubeaccel.protocol.errors import invalid


@dataclass(frozen=True)
class SimProfile:
    vendor_id: int
    device_id: int
    class_code: int
    subsystem_device_id: int
    bars: tuple[Bar, ...]
    native_driver: str | None


def _gpu_bars(bar1: int) -> tuple[Bar, ...]:
    """An NVIDIA data-center GPU's layout: BAR0 registers, BAR1 the memory aperture, BAR3 32 MiB, BAR5 I/O."""
    return (
        Bar(0, 16 << 20, BarKind.MEM32),
        Bar(1, bar1, BarKind.MEM64, prefetch=True),
        Bar(3, 32 << 20, BarKind.MEM64, prefetch=True),
        Bar(5, 128, BarKind.IO),
    )


PROFILES: dict[str, SimProfile] = {
    # the part the shipped GPU templates target: H100 PCIe (no NVSwitch, so a node can serve it today)
    "h100": SimProfile(0x10DE, 0x2331, 0x030200, 0x1839, _gpu_bars(128 << 30), "nvidia"),
    "h100nvl": SimProfile(0x10DE, 0x2321, 0x030200, 0x1839, _gpu_bars(128 << 30), "nvidia"),
    "h100sxm": SimProfile(0x10DE, 0x2330, 0x030200, 0x16C1, _gpu_bars(128 << 30), "nvidia"),
    "a100": SimProfile(0x10DE, 0x20B2, 0x030200, 0x1463, _gpu_bars(128 << 30), "nvidia"),
    "t4": SimProfile(0x10DE, 0x1EB8, 0x030200, 0x12A2, _gpu_bars(256 << 20), "nvidia"),
    "edu": SimProfile(0x1234, 0x11E8, 0x00FF00, 0x1100, (Bar(0, 1 << 20, BarKind.MEM32),), None),
    # HGX H100's third-generation NVSwitch (bridge/other): `h100sxmx8,4xnvswitch` is an HGX baseboard
    "nvswitch": SimProfile(0x10DE, 0x22A3, 0x068000, 0x1796, (Bar(0, 32 << 20, BarKind.MEM32),), None),
}

_PART = re.compile(r"(?:(\d{1,3})x([a-z0-9]+)|([a-z0-9]+?)x(\d{1,3})|([a-z0-9]+))")
MAX_DEVICES = 64
WRITE_LOG = 512


def parse_profile_spec(spec: str) -> list[str]:
    """`h100x8`, `2xh100,2xt4`, `edu` → ordered list of profile names, one per device."""
    if not isinstance(spec, str) or not spec or len(spec) > 200:
        raise invalid("host.invalid_profile", f"invalid profile spec {spec!r}", layer="host_hardware")
    names: list[str] = []
    for part in spec.lower().split(","):
        m = _PART.fullmatch(part.strip())
        if m is None:
            raise invalid("host.invalid_profile", f"invalid profile part {part!r}", layer="host_hardware")
        if m[1]:
            count, name = int(m[1]), m[2]
        elif m[3]:
            name, count = m[3], int(m[4])
        else:
            name, count = m[5], 1
        if name not in PROFILES:
            raise invalid(
                "host.unknown_profile",
                f"unknown device profile {name!r}; known: {sorted(PROFILES)}",
                layer="host_hardware",
            )
        if count < 1:
            raise invalid("host.invalid_profile", f"count must be >= 1 in {part!r}", layer="host_hardware")
        names += [name] * count
    if len(names) > MAX_DEVICES:
        raise invalid("host.invalid_profile", f"at most {MAX_DEVICES} devices", layer="host_hardware")
    return names


class Fault(StrEnum):
    VANISH = "vanish"  # the function disappears from the bus
    BIND_FAIL = "bind_fail"  # driver_override/drivers_probe has no effect
    RESET_FAIL = "reset_fail"  # writing `reset` fails
    HOLDER_STUCK = "holder_stuck"  # holders never let go
    HEALTH_FAIL = "health_fail"  # AER fatal error and config space reads 0xffff
    IDENTITY_CHANGE = "identity_change"  # a different card now answers at the same address
    GROUP_NOT_VIABLE = "group_not_viable"  # a companion function in the group is on a host driver
    AER_FATAL = "aer_fatal"  # one fatal AER error was logged; the device still answers


class SimulatedPciHost:
    """Implements `PciHost`. State lives in `self._s` (JSON-able) and, with `path`, on disk."""

    def __init__(self, profile: str = "h100x8", path: Path | None = None) -> None:
        self.path = path
        self._s: dict[str, Any] = {}
        self._stamp: tuple[int, int, int] | None = None
        if path is not None and path.exists():
            self._load()
        else:
            self._s = self._fresh(parse_profile_spec(profile), profile)
            self._save()

    # ---- state ----------------------------------------------------------------------------------
    @staticmethod
    def _entry(name: str, i: int, numa: int) -> dict[str, Any]:
        p = PROFILES[name]
        return {
            "profile": name,
            "vendor_id": p.vendor_id,
            "device_id": p.device_id,
            "class_code": p.class_code,
            "subsystem_device_id": p.subsystem_device_id,
            "numa_node": numa,
            "iommu_group": 20 + i,
            "driver": p.native_driver,
            "bars": [b.to_json() for b in p.bars],
            "serial": f"SIM-{name.upper()}-{i:04d}",
        }

    def add_function(self, profile: str) -> PciAddress:
        """Hardware that appears on the bus later (a test's doing): the next free bus, its own IOMMU group."""
        parse_profile_spec(profile)
        with self._locked(write=True):
            i = len(self._s["functions"])
            address = PciAddress(0, 0x10 + i, 0, 0)
            self._s["functions"][str(address)] = self._entry(profile, i, 0)
        return address

    @classmethod
    def _fresh(cls, names: list[str], spec: str) -> dict[str, Any]:
        funcs: dict[str, dict[str, Any]] = {}
        half = max(1, (len(names) + 1) // 2)
        for i, name in enumerate(names):
            funcs[str(PciAddress(0, 0x10 + i, 0, 0))] = cls._entry(name, i, 0 if i < half else 1)
        return {
            "spec": spec,
            "functions": funcs,
            "holders": {},
            "faults": {},
            "writes": [],
            "resets": {},
            "procs": {},
            "next_pid": 40000,
        }

    @contextmanager
    def _locked(self, write: bool) -> Iterator[None]:
        if self.path is None:
            yield
            return
        lock = self.path.with_suffix(".lock")
        with open(lock, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                self._load()
                yield
                if write:
                    self._save()
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _load(self) -> None:
        """Re-read only when another process changed the file (stat is cheap; parsing is not)."""
        assert self.path is not None
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp != self._stamp:
            self._s = json.loads(self.path.read_text())
            self._stamp = stamp

    def _save(self) -> None:
        del self._s["writes"][:-WRITE_LOG]  # a bounded log: a long-running demo must not grow the file
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._s))
        os.replace(tmp, self.path)
        st = self.path.stat()
        self._stamp = (st.st_mtime_ns, st.st_size, st.st_ino)

    def _faulty(self, fault: Fault, address: PciAddress) -> bool:
        return fault.value in self._s["faults"].get(str(address), [])

    # ---- fault injection and VM-side simulation ------------------------------------------------
    def inject(self, fault: Fault, address: PciAddress) -> None:
        with self._locked(write=True):
            faults = self._s["faults"].setdefault(str(address), [])
            if fault.value not in faults:
                faults.append(fault.value)

    def clear(self, fault: Fault, address: PciAddress) -> None:
        with self._locked(write=True):
            faults = self._s["faults"].get(str(address), [])
            if fault.value in faults:
                faults.remove(fault.value)

    def add_holder(self, address: PciAddress, holder: Holder) -> None:
        with self._locked(write=True):
            self._s["holders"].setdefault(str(address), []).append(
                {"pid": holder.pid, "command": holder.command, "path": holder.path}
            )

    def remove_holders(self, address: PciAddress, pid: int) -> bool:
        """Returns False when the holder refuses to let go (HOLDER_STUCK)."""
        with self._locked(write=True):
            if self._faulty(Fault.HOLDER_STUCK, address):
                return False
            hs = self._s["holders"].get(str(address), [])
            self._s["holders"][str(address)] = [h for h in hs if h["pid"] != pid]
            return True

    # ---- simulated processes (shims and VMMs survive a Cubelet restart, as real ones do) --------
    def spawn(self, tag: str, command: str, *, immortal: bool = False) -> int:
        with self._locked(write=True):
            pid = int(self._s["next_pid"])
            self._s["next_pid"] = pid + 1
            self._s["procs"][str(pid)] = {"tag": tag, "command": command, "immortal": immortal}
            return pid

    def find_process(self, tag: str) -> int | None:
        with self._locked(write=False):
            for pid, p in self._s["procs"].items():
                if p["tag"] == tag:
                    return int(pid)
            return None

    def kill(self, pid: int) -> bool:
        """SIGKILL; False when the process survives (stuck in the kernel, as a VMM in D state can)."""
        with self._locked(write=True):
            p = self._s["procs"].get(str(pid))
            if p is None:
                return True
            if p["immortal"]:
                return False
            del self._s["procs"][str(pid)]
            for addr, hs in self._s["holders"].items():
                if not self._faulty(Fault.HOLDER_STUCK, PciAddress.parse(addr)):
                    self._s["holders"][addr] = [h for h in hs if h["pid"] != pid]
            return True

    def unstick(self, pid: int) -> None:
        """The kernel finally lets a stuck (immortal) process go: the next kill takes."""
        with self._locked(write=True):
            p = self._s["procs"].get(str(pid))
            if p is not None:
                p["immortal"] = False

    def pause(self, pid: int, stopped: bool = True) -> None:
        """SIGSTOP (`stopped` False: SIGCONT): a stopped shim answers nothing on its control socket until it is
        continued; a kill still takes. Persisted, so a test can stop a shim a Cubelet in another process drives."""
        with self._locked(write=True):
            p = self._s["procs"].get(str(pid))
            if p is not None:
                p["stopped"] = stopped

    def stopped(self, pid: int) -> bool:
        with self._locked(write=False):
            p = self._s["procs"].get(str(pid))
            return p is not None and bool(p.get("stopped"))

    def command_of(self, pid: int) -> str | None:
        with self._locked(write=False):
            p = self._s["procs"].get(str(pid))
            return None if p is None else str(p["command"])

    def alive(self, pid: int) -> bool:
        with self._locked(write=False):
            return str(pid) in self._s["procs"]

    def writes(self) -> list[str]:
        with self._locked(write=False):
            return list(self._s["writes"])

    def set_reset_delay(self, seconds: float) -> None:
        """How long every reset takes (a real FLR takes ≥ 100 ms, a bus reset ~1 s); persisted, so a test or a
        benchmark can slow the resets of a Cubelet running in another process."""
        with self._locked(write=True):
            self._s["reset_delay_s"] = float(seconds)

    def reset_count(self, address: PciAddress) -> int:
        with self._locked(write=False):
            return int(self._s["resets"].get(str(address), 0))

    # ---- PciHost --------------------------------------------------------------------------------
    def _function(self, addr: str) -> PciFunction | None:
        raw = self._s["functions"].get(addr)
        address = PciAddress.parse(addr)
        if raw is None or self._faulty(Fault.VANISH, address):
            return None
        f = PciFunction(
            address=address,
            vendor_id=raw["vendor_id"],
            device_id=raw["device_id"],
            subsystem_vendor_id=raw["vendor_id"],
            subsystem_device_id=raw["subsystem_device_id"],
            class_code=raw["class_code"],
            numa_node=raw["numa_node"],
            iommu_group=raw["iommu_group"],
            driver=raw["driver"],
            bars=tuple(Bar.from_json(b) for b in raw.get("bars", ())),
            reset_method=("flr", "bus"),
            aer_fatal=0,
            aer_nonfatal=0,
            serial=raw["serial"],
        )
        if self._faulty(Fault.IDENTITY_CHANGE, address):
            f = replace(f, device_id=f.device_id ^ 0x0001, serial=f"{raw['serial']}-SWAPPED")
        if self._faulty(Fault.HEALTH_FAIL, address) or self._faulty(Fault.AER_FATAL, address):
            f = replace(f, aer_fatal=1)
        return f

    def _companion(self, addr: str) -> PciFunction | None:
        """The audio function a GPU shares its IOMMU group with, present only under GROUP_NOT_VIABLE."""
        a = PciAddress.parse(addr)
        raw = self._s["functions"][addr]
        return PciFunction(
            address=PciAddress(a.domain, a.bus, a.slot, 1),
            vendor_id=raw["vendor_id"],
            device_id=0x22A3,
            class_code=0x040300,
            numa_node=raw["numa_node"],
            iommu_group=raw["iommu_group"],
            driver="snd_hda_intel",
        )

    def functions(self) -> list[PciFunction]:
        with self._locked(write=False):
            out = []
            for addr in sorted(self._s["functions"]):
                f = self._function(addr)
                if f is not None:
                    out.append(f)
                    if self._faulty(Fault.GROUP_NOT_VIABLE, f.address):
                        c = self._companion(addr)
                        assert c is not None
                        out.append(c)
            return out

    def function(self, address: PciAddress) -> PciFunction | None:
        with self._locked(write=False):
            if str(address) in self._s["functions"]:
                return self._function(str(address))
            if address.function == 1:  # a companion audio function, present only under GROUP_NOT_VIABLE
                gpu = str(PciAddress(address.domain, address.bus, address.slot, 0))
                if gpu in self._s["functions"] and self._faulty(Fault.GROUP_NOT_VIABLE, PciAddress.parse(gpu)):
                    return self._companion(gpu)
            return None

    def iommu_group_members(self, group: int) -> list[PciAddress]:
        """What /sys/kernel/iommu_groups/N/devices lists: one group's functions, without building every
        function of the host (a real kernel does not walk the bus for this either)."""
        with self._locked(write=False):
            out = []
            for addr, raw in sorted(self._s["functions"].items()):
                if raw["iommu_group"] != group:
                    continue
                address = PciAddress.parse(addr)
                if self._faulty(Fault.VANISH, address):
                    continue
                out.append(address)
                if self._faulty(Fault.GROUP_NOT_VIABLE, address):
                    out.append(PciAddress(address.domain, address.bus, address.slot, 1))
            return out

    def bind(self, address: PciAddress, driver: str) -> None:
        with self._locked(write=True):
            raw = self._s["functions"].get(str(address))
            if raw is None or self._faulty(Fault.VANISH, address):
                raise host_error("host.device_missing", f"no PCI function at {address}")
            self._s["writes"].append(f"{address}/driver_override={driver}")
            if raw["driver"]:
                self._s["writes"].append(f"drivers/{raw['driver']}/unbind={address}")
            self._s["writes"].append(f"drivers_probe={address}")
            if self._faulty(Fault.BIND_FAIL, address):
                raw["driver"] = None
                raise host_error("host.bind_failed", f"{address} did not bind to {driver}")
            raw["driver"] = driver

    def reset(self, address: PciAddress, methods: tuple[str, ...] = ()) -> None:
        with self._locked(write=True):
            if str(address) not in self._s["functions"] or self._faulty(Fault.VANISH, address):
                raise host_error("host.device_missing", f"no PCI function at {address}")
            if methods:
                self._s["writes"].append(f"{address}/reset_method={' '.join(methods)}")
            self._s["writes"].append(f"{address}/reset=1")
            if self._faulty(Fault.RESET_FAIL, address):
                raise host_error("host.reset_failed", f"writing reset for {address} failed: EIO")
            self._s["resets"][str(address)] = int(self._s["resets"].get(str(address), 0)) + 1
            delay = float(self._s.get("reset_delay_s", 0.0))
        if delay > 0:  # the reset "runs" outside the file lock: resets of different devices overlap, as on a host
            time.sleep(delay)

    def config_vendor_id(self, address: PciAddress) -> int:
        with self._locked(write=False):
            if self._faulty(Fault.HEALTH_FAIL, address) or self._faulty(Fault.VANISH, address):
                return 0xFFFF
            raw = self._s["functions"].get(str(address))
            return 0xFFFF if raw is None else int(raw["vendor_id"])

    def holders(self, address: PciAddress) -> list[Holder]:
        with self._locked(write=False):
            return [Holder(**h) for h in self._s["holders"].get(str(address), [])]

    def driver_available(self, driver: str) -> bool:
        return driver in ("vfio-pci", "nvidia")
