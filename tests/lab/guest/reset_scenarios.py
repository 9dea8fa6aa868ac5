"""The reset ladder (model/reset_ladder.py) on the real kernel: every rung through the real `reset_method` and
`reset` attributes of the lab guest's sysfs, each followed by the backend's post-reset identity and health check.

Topology beyond the lab's own (tests/lab/test_vfio_lab_reset.py, RESET_TOPOLOGY): a virtio-rng behind a root port
(QEMU gives PCIe virtio functions FLR), an edu multifunction pair behind a root port (one group; the kernel
lists `bus` for function 0, enumerated while it was alone on the bus), and a switch behind a root port with an edu on
its internal bus beside a downstream port that has an edu below it (two groups under one bridge).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import procs
from scenarios import RC, RP, fn, ms_since, problems

from cubeaccel.backends.base import ResetContext
from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.host.pci.readiness import HostRoots
from cubeaccel.host.pci.sysfs import SysfsPciHost
from cubeaccel.model.device import DeviceRecord, PciAddress, device_id_for
from cubeaccel.model.states import DeviceState

SYS = Path("/sys/bus/pci/devices")
VIRTIO_RNG = ("0x1af4", "0x1044")
EDU = ("0x1234", "0x11e8")
host = SysfsPciHost()
backend = VfioBackend(host, allow=["1234:11e8", "1af4:1044"], readiness_roots=HostRoots())


def record(address: PciAddress) -> DeviceRecord:
    f = fn(address)
    (d,) = [d for d in backend.discover() if d.address == address]
    return DeviceRecord(
        id=device_id_for("vfio", address), address=address, identity=f.identity, accel_class=d.accel_class,
        backend="vfio", numa_node=f.numa_node, iommu_group=f.iommu_group, expected_driver="vfio-pci", labels={},
        state=DeviceState.RELEASING, generation=1, reason=None, sandbox_id=None, updated_at=0.0,
    )  # fmt: skip


def ensure_vfio(*addresses: PciAddress) -> None:
    for a in addresses:
        if fn(a).driver != "vfio-pci":
            prep = backend.prepare(record(a))
            assert prep.ok, prep.problems


def _ids(d: Path) -> tuple[str, str]:
    return (d / "vendor").read_text().strip(), (d / "device").read_text().strip()


def _find(ids: tuple[str, str], where: Any = lambda a: True) -> PciAddress:
    for d in sorted(SYS.iterdir()):
        a = PciAddress.parse(d.name)
        if _ids(d) == ids and where(a):
            return a
    raise AssertionError(f"no {ids} in the lab guest")


def _parent(a: PciAddress) -> str:
    return (SYS / str(a)).resolve().parent.name


def _ladder(a: PciAddress, context: ResetContext | None = None, via: VfioBackend = backend) -> dict[str, Any]:
    ensure_vfio(a)
    before = fn(a)
    methods_before = (SYS / str(a) / "reset_method").read_text().strip() if before.reset_method else None
    t0 = time.monotonic()
    result = via.reset_ladder(record(a), context or ResetContext())
    elapsed = ms_since(t0)
    after = fn(a)
    return {
        "address": str(a),
        "group": before.iommu_group,
        "reset_method": list(before.reset_method),
        "reset_method_after": (SYS / str(a) / "reset_method").read_text().strip() if methods_before else None,
        "reach": [str(x) for x in host.bus_reach(a) or []] if host.bus_reach(a) is not None else None,
        "problems": problems(result.problems),
        "attempts": [x.to_json() for x in result.attempts],
        "ms": elapsed,
        "identity_same": before.identity == after.identity and before.bars == after.bars,
        "validate_after": problems(backend.validate(record(a))),
    }


def ladder_flr() -> dict[str, Any]:
    """Rung 1 on a function with FLR; then the same function's bus rung (the operator forbids its function resets:
    the ladder's rung 2 through `reset_method` narrowed to `bus`, as when FLR did not take)."""
    rng = _find(VIRTIO_RNG)
    out = {"function": _ladder(rng)}
    bus_only = VfioBackend(host, allow=["1af4:1044"], reset_methods={"bus"})
    out["bus"] = _ladder(rng, via=bus_only)
    return out


def ladder_bus() -> dict[str, Any]:
    """The edu behind the lab's root port: no FLR, the kernel offers `bus`; alone in its group, idle."""
    return _ladder(RP)


def ladder_no_reset() -> dict[str, Any]:
    """The edu on the root complex: no reset method at all, no bridge above it → quarantine."""
    return _ladder(RC)


def ladder_refused_busy() -> dict[str, Any]:
    """The multifunction pair behind a root port (one group): while a VMM-like process holds function 1 (or the
    Cubelet has it reserved), a bus reset for function 0 is refused naming it; idle, the rule allows it and the
    kernel has the last word."""
    pf1 = _find(EDU, lambda a: a.bus != 0 and a.function == 1)
    pf0 = PciAddress.parse(str(pf1)[:-1] + "0")
    ensure_vfio(pf0, pf1)
    h = procs.spawn_holder(str(pf1), fn(pf1).iommu_group or -1, device_fd_only=True)
    try:
        held = _ladder(pf0)
    finally:
        h.stop()
    deadline = time.monotonic() + 5
    while (SYS / str(pf1) / "enable").read_text().strip() != "0" and time.monotonic() < deadline:
        time.sleep(0.02)
    claimed = _ladder(pf0, ResetContext(reserved={pf1: "reserved (sandbox sb-lab)"}))
    return {"pf1": str(pf1), "held": held, "claimed": claimed, "idle": _ladder(pf0)}


def ladder_refused_other_group() -> dict[str, Any]:
    """An edu on a switch's internal bus, beside a downstream port with an edu below it: the kernel isolates the
    edu from the port (its path up has ACS: QEMU's root port, a single-function upstream port), so the port and
    the function below it are another group, and a bus reset of the edu's bus would reach them → refused, naming
    them, before anything is written."""
    sw = _find(EDU, lambda a: _parent(a) != "pci0000:00" and _is_switch_bus(a))
    ensure_vfio(sw)
    out = _ladder(sw)
    out["groups"] = {str(a): fn(a).iommu_group for a in host.bus_reach(sw) or []}
    return out


def _is_switch_bus(a: PciAddress) -> bool:
    """Its bridge is a switch upstream port (PCIe type 5), read from the bridge's config space."""
    bridge = (SYS / str(a)).resolve().parent
    config = (bridge / "config").read_bytes()
    ptr = config[0x34]
    while ptr:
        if config[ptr] == 0x10:  # the PCI Express capability: its type in bits 4..7 of byte 2
            return (config[ptr + 2] >> 4) & 0xF == 5
        ptr = config[ptr + 1]
    return False


SCENARIOS = {
    "ladder_refused_other_group": ladder_refused_other_group,
    "ladder_flr": ladder_flr,
    "ladder_bus": ladder_bus,
    "ladder_no_reset": ladder_no_reset,
    "ladder_refused_busy": ladder_refused_busy,
}
