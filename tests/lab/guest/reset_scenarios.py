"""The reset ladder (model/reset_ladder.py) on the real kernel: every rung through the real `reset_method` and
`reset` attributes of the lab guest's sysfs, each followed by the backend's post-reset identity and health check.

Topology beyond the lab's own (tests/lab/test_vfio_lab_reset.py, RESET_TOPOLOGY): a virtio-rng behind a root port
(QEMU gives PCIe virtio functions FLR), an edu multifunction pair behind a root port (one group; the kernel offers
no reset for either), and an edu beside a switch upstream port behind a root port, with an edu below the switch's
downstream port (a bus reset of that edu's bus reaches the switch and the edu below it).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import procs
from scenarios import RC, RP, ensure_vfio, fn, ms_since, problems, record

from cubeaccel.backends.base import ResetContext
from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.host.readiness import HostRoots
from cubeaccel.host.sysfs import SysfsPciHost
from cubeaccel.model.device import PciAddress

SYS = Path("/sys/bus/pci/devices")
VIRTIO_RNG = ("0x1af4", "0x1044")
EDU = ("0x1234", "0x11e8")
host = SysfsPciHost()
backend = VfioBackend(host, allow=["1234:11e8", "1af4:1044"], readiness_roots=HostRoots())


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


def _is_bridge(a: PciAddress) -> bool:
    return (SYS / str(a) / "class").read_text().strip().startswith("0x0604")


def _sibling_bridge(a: PciAddress) -> bool:
    """The edu beside the switch upstream port (function 0 of its slot is a bridge)."""
    f0 = PciAddress.parse(str(a)[:-1] + "0")
    return a.function == 1 and (SYS / str(f0)).exists() and _is_bridge(f0)


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
        "attempts": result.attempts,
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
    """The multifunction pair behind a root port (one group): while a VMM-like process holds function 1, a bus
    reset for function 0 is refused naming it; idle, the rule would allow it, but the kernel offers no reset for a
    function that shares its bus, so the device is quarantined as having no reset method."""
    pf1 = _find(EDU, lambda a: a.bus != 0 and a.function == 1 and not _sibling_bridge(a))
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
    claimed = _ladder(pf0, ResetContext(claims={pf1: "reserved (sandbox sb-lab)"}))
    return {"pf1": str(pf1), "held": held, "claimed": claimed, "idle": _ladder(pf0)}


def ladder_refused_foreign() -> dict[str, Any]:
    """The edu beside a switch upstream port: a bus reset of its bus would reach the switch and the edu below it,
    in other IOMMU groups."""
    beside = _find(EDU, _sibling_bridge)
    reach = host.bus_reach(beside) or []
    below = [a for a in reach if a != beside and _ids(SYS / str(a)) == EDU]
    out = _ladder(beside)
    out["below"] = [{"address": str(a), "group": fn(a).iommu_group} for a in below]
    out["groups"] = {str(a): fn(a).iommu_group for a in reach}
    return out


SCENARIOS = {
    "ladder_flr": ladder_flr,
    "ladder_bus": ladder_bus,
    "ladder_no_reset": ladder_no_reset,
    "ladder_refused_busy": ladder_refused_busy,
    "ladder_refused_foreign": ladder_refused_foreign,
}
