"""Lab scenarios: cubeaccel's real VfioBackend + SysfsPciHost against the guest kernel's VFIO stack.

Each scenario returns observations (JSON-able); the host-side tests assert on them, so a scenario never decides
pass or fail itself. Scenarios run in plan order in one boot and leave the devices bound to vfio-pci and idle.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import procs
import vfio_ioctl

from cubeaccel.backends.base import Problem
from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.host.pci.base import PciFunction
from cubeaccel.host.pci.readiness import HostRoots, check_host
from cubeaccel.host.pci.sysfs import SysfsPciHost
from cubeaccel.model.device import DeviceRecord, PciAddress, device_id_for
from cubeaccel.model.states import DeviceState

# The topology harness.py boots: see LAB_DEVICES there.
RC = PciAddress.parse("0000:00:03.0")  # edu on the root complex: no reset method
RP = PciAddress.parse("0000:01:00.0")  # edu behind the pcie-root-port at 00:04.0: bus reset
MF0 = PciAddress.parse("0000:00:05.0")  # multifunction pair: one shared group
MF1 = PciAddress.parse("0000:00:05.1")
ALL = (RC, RP, MF0, MF1)
EDU = "1234:11e8"
TESTDEV = "1b36:0005"  # pci-testdev: only the large-BAR boot has one (test_vfio_lab_large_bar.py)
SYS = Path("/sys/bus/pci/devices")

host = SysfsPciHost()
backend = VfioBackend(host, allow=[EDU, TESTDEV], readiness_roots=HostRoots())


def fn(address: PciAddress) -> PciFunction:
    f = host.function(address)
    assert f is not None, f"no {address}"
    return f


def record(address: PciAddress, state: DeviceState = DeviceState.ALLOCATABLE) -> DeviceRecord:
    f = fn(address)
    return DeviceRecord(
        id=device_id_for("vfio", address),
        address=address,
        identity=f.identity,
        accel_class=next(d.accel_class for d in backend.discover() if d.address == address),
        backend="vfio",
        numa_node=f.numa_node,
        iommu_group=f.iommu_group,
        expected_driver="vfio-pci",
        labels={},
        state=state,
        generation=1,
        reason=None,
        sandbox_id=None,
        updated_at=0.0,
    )


def problems(ps: list[Problem]) -> list[dict[str, Any]]:
    return [{"code": p.code, "message": p.message, "hard": p.hard} for p in ps]


def attr(address: PciAddress, name: str) -> str | None:
    try:
        return (SYS / str(address) / name).read_text().strip()
    except OSError:
        return None


def enable_count(address: PciAddress) -> int:
    return int(attr(address, "enable") or "-1")


def holders(address: PciAddress) -> list[dict[str, Any]]:
    return [h.__dict__ for h in host.holders(address)]


def ms_since(t0: float) -> float:
    return round((time.monotonic() - t0) * 1000, 1)


def ensure_vfio(*addresses: PciAddress) -> None:
    for a in addresses:
        if fn(a).driver != "vfio-pci":
            prep = backend.prepare(record(a))
            assert prep.ok, prep.problems


# ---- scenarios ----------------------------------------------------------------------------------------------------
def readiness() -> dict[str, Any]:
    checks = check_host(Path("/sys"), Path("/dev"), Path("/proc"))
    return {
        "checks": {c.name: {"status": c.status, "code": c.code} for c in checks.checks},
        "backend_failures": [p.code for p in backend.readiness()],
        "kernel": os.uname().release,
    }


def discovery() -> dict[str, Any]:
    found = {}
    for d in backend.discover():
        f = fn(d.address)
        found[str(d.address)] = {
            "iommu_group": d.iommu_group,
            "driver": d.driver,
            "reset_method": list(f.reset_method),
            "has_reset_attr": (SYS / str(d.address) / "reset").exists(),
            "group_members": [str(m) for m in host.iommu_group_members(d.iommu_group)] if d.iommu_group else [],
            "class": d.accel_class.value,
            "parent": os.path.basename(os.path.dirname(os.path.realpath(SYS / str(d.address)))),
        }
    return {"devices": found}


def prepare() -> dict[str, Any]:
    out = {}
    for a in ALL:
        t0 = time.monotonic()
        prep = backend.prepare(record(a))
        elapsed = ms_since(t0)
        f = fn(a)
        again = backend.prepare(record(a))
        out[str(a)] = {
            "problems": problems(prep.problems),
            "original_driver": prep.original_driver,
            "changed": prep.changed,
            "driver": f.driver,
            "driver_override": f.driver_override,
            "group_file": f"/dev/vfio/{f.iommu_group}",
            "group_file_exists": os.path.exists(f"/dev/vfio/{f.iommu_group}"),
            "elapsed_ms": elapsed,
            "again_changed": again.changed,
            "again_problems": problems(again.problems),
        }
    return out


def device_files() -> dict[str, Any]:
    ensure_vfio(*ALL)
    out: dict[str, Any] = {}
    for a in ALL:
        files = host.device_files(a)
        out[str(a)] = {
            "files": files,
            "missing": [p for p in files if not os.path.exists(p)],
            "vfio_dev_sysfs": sorted(os.listdir(SYS / str(a) / "vfio-dev"))
            if (SYS / str(a) / "vfio-dev").is_dir()
            else [],
        }
    out["dev_vfio_devices_exists"] = os.path.isdir("/dev/vfio/devices")
    return out


def validate() -> dict[str, Any]:
    ensure_vfio(*ALL)
    return {str(a): problems(backend.validate(record(a))) for a in ALL}


def group_viability() -> dict[str, Any]:
    """One member of the shared group on another driver. The kernel counts pci-stub as harmless (its allow-list of
    drivers that never touch a device), uio_pci_generic not; cubeaccel refuses both."""
    ensure_vfio(*ALL)
    group = fn(MF0).iommu_group
    assert group is not None
    out: dict[str, Any] = {}
    for driver in ("uio_pci_generic", "pci-stub"):
        host.bind(MF1, driver)
        try:
            seen = {
                "mf1_driver": fn(MF1).driver,
                "validate_mf0": problems(backend.validate(record(MF0))),
                "kernel_viable": vfio_ioctl.group_viable(group),
            }
        finally:
            prep = backend.prepare(record(MF1))
        seen["back_to_vfio"] = problems(prep.problems)
        out[driver] = seen
    out["validate_mf0_after"] = problems(backend.validate(record(MF0)))
    out["kernel_viable_after"] = vfio_ioctl.group_viable(group)
    return out


def _holder_checks(address: PciAddress) -> dict[str, Any]:
    t0 = time.monotonic()
    held = holders(address)
    return {
        "holders": held,
        "holders_ms": ms_since(t0),
        "enable": enable_count(address),
        "validate": problems(backend.validate(record(address))),
        "health_allocatable": problems(backend.health(record(address))),
        "health_attached": problems(backend.health(record(address, DeviceState.ATTACHED))),
        "wait_released_short": problems(backend.wait_released(record(address), 0.3)),
    }


def _after_stop(address: PciAddress, h: procs.HolderProc) -> dict[str, Any]:
    t0 = time.monotonic()
    h.stop()
    waited = backend.wait_released(record(address), 5.0)
    return {
        "wait_released": problems(waited),
        "released_ms": ms_since(t0),
        "enable": enable_count(address),
        "holders": holders(address),
    }


def _second_open(address: PciAddress) -> str:
    """What a second VMM gets: the errno name of its first refused step, or `opened`."""
    try:
        other = procs.spawn_holder(str(address), fn(address).iommu_group or -1)
    except OSError as e:
        text = str(e)
        for name in ("EBUSY", "EINVAL", "EPERM"):
            if os.strerror(getattr(errno, name)) in text:
                return name
        return text
    other.stop()
    return "opened"


def holder_full() -> dict[str, Any]:
    ensure_vfio(RP)
    idle = {"enable": enable_count(RP), "holders": holders(RP)}
    h = procs.spawn_holder(str(RP), fn(RP).iommu_group or -1)
    try:
        held = _holder_checks(RP)
        held["holder_pid"] = h.pid
        held["fds"] = sorted({os.readlink(f"/proc/{h.pid}/fd/{n}") for n in os.listdir(f"/proc/{h.pid}/fd")})
        held["second_open"] = _second_open(RP)
    finally:
        after = _after_stop(RP, h)
    return {"idle": idle, "held": held, "after": after}


def holder_device_fd_only() -> dict[str, Any]:
    ensure_vfio(RP)
    h = procs.spawn_holder(str(RP), fn(RP).iommu_group or -1, device_fd_only=True)
    try:
        held = _holder_checks(RP)
        held["holder_pid"] = h.pid
        held["fds"] = sorted({os.readlink(f"/proc/{h.pid}/fd/{n}") for n in os.listdir(f"/proc/{h.pid}/fd")})
        held["second_open"] = _second_open(RP)
    finally:
        after = _after_stop(RP, h)
    return {"held": held, "after": after}


def _ns_view() -> dict[str, Any]:
    return {"holders": holders(RP), "enable": enable_count(RP), "pids_visible": len(procs.visible_pids())}


def holder_other_pidns() -> dict[str, Any]:
    ensure_vfio(RP)
    out: dict[str, Any] = {}
    # The holder in its own PID namespace, cubeaccel in the initial one: /proc shows it.
    h = procs.spawn_holder(str(RP), fn(RP).iommu_group or -1, own_pidns=True)
    try:
        out["holder_in_child_ns"] = {"holder_pid": h.pid, "holders": holders(RP), "enable": enable_count(RP)}
    finally:
        out["holder_in_child_ns"]["after"] = _after_stop(RP, h)
    # cubeaccel in a PID namespace of its own (a containerised Cubelet), the holder outside: /proc cannot show it.
    for label, fd_only in (("checker_in_child_ns", False), ("checker_in_child_ns_device_fd_only", True)):
        h = procs.spawn_holder(str(RP), fn(RP).iommu_group or -1, device_fd_only=fd_only)
        try:
            out[label] = {"holder_pid": h.pid, **procs.in_new_pidns(_ns_view)}
        finally:
            out[label]["after"] = _after_stop(RP, h)
    out["idle_from_child_ns"] = procs.in_new_pidns(_ns_view)
    return out


def cleanup_bus_reset() -> dict[str, Any]:
    ensure_vfio(RP)
    before = fn(RP)
    t0 = time.monotonic()
    cleaned = backend.cleanup(record(RP))
    elapsed = ms_since(t0)
    after = fn(RP)
    return {
        "reset_method": list(before.reset_method),
        "cleanup": problems(cleaned),
        "cleanup_ms": elapsed,
        "identity_same": before.identity == after.identity,
        "validate_after": problems(backend.validate(record(RP))),
    }


def cleanup_no_reset() -> dict[str, Any]:
    ensure_vfio(RC)
    f = fn(RC)
    return {
        "reset_method": list(f.reset_method),
        "has_reset_attr": (SYS / str(RC) / "reset").exists(),
        "cleanup": problems(backend.cleanup(record(RC))),
        "validate_after": problems(backend.validate(record(RC))),
    }


def restore_host() -> dict[str, Any]:
    """An operator had the device on a driver without an id table (bound by override); cubeaccel takes it, then gives
    it back."""
    out: dict[str, Any] = {}
    for driver in ("uio_pci_generic", "pci-stub"):
        host.restore_driver(RC, None)
        (SYS / str(RC) / "driver_override").write_text(driver)
        Path("/sys/bus/pci/drivers_probe").write_text(str(RC))
        start = fn(RC).driver
        prep = backend.prepare(record(RC))
        restored = backend.restore_host(record(RC), prep.original_driver)
        f = fn(RC)
        out[driver] = {
            "start_driver": start,
            "original_driver": prep.original_driver,
            "prepare": problems(prep.problems),
            "restore": problems(restored),
            "driver_after": f.driver,
            "driver_override_after": f.driver_override,
        }
    prep = backend.prepare(record(RC))
    unbound = backend.restore_host(record(RC), None)
    out["none"] = {"restore": problems(unbound), "driver_after": fn(RC).driver}
    ensure_vfio(RC)
    out["back_to_vfio"] = fn(RC).driver
    return out


SCENARIOS = {
    f.__name__: f
    for f in (
        readiness,
        discovery,
        prepare,
        device_files,
        validate,
        group_viability,
        holder_full,
        holder_device_fd_only,
        holder_other_pidns,
        cleanup_bus_reset,
        cleanup_no_reset,
        restore_host,
    )
}


def prepare_no_iommu() -> dict[str, Any]:
    """The same guest booted without the emulated IOMMU: no groups, so vfio-pci cannot take the device."""
    before = fn(RC)
    prep = backend.prepare(record(RC))
    after = fn(RC)
    return {
        "iommu_group": before.iommu_group,
        "groups_present": host.iommu_groups_present(),
        "problems": problems(prep.problems),
        "changed": prep.changed,
        "driver_after": after.driver,
        "driver_override_after": after.driver_override,
        "readiness": [p.code for p in backend.readiness()],
    }


SCENARIOS["prepare_no_iommu"] = prepare_no_iommu
