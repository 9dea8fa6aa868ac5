"""VFIO passthrough: the reference backend. Works on any `PciHost` (real sysfs, fake tree, simulation).

The backend describes and acts; Cubelet decides (STYLE §5). Every check returns `Problem`s with
stable codes; `hard` ones make a device `unhealthy`, soft ones (safety unproven) `quarantined`.

Host preparation API (issue #3 item 4):
- `prepare(device)` binds the device to vfio-pci (driver_override + unbind + drivers_probe) and returns
  a `HostPreparation` carrying `original_driver`. The caller persists it (Cubelet store) — the backend
  keeps no state that must survive a restart.
- `restore_host(device, original_driver)` gives the device back to that driver (None: leave unbound),
  e.g. when an operator disables it and asks for the host driver back.
Both are the `HostBinding` capability, the AER baselines the `AerBaselines` one (`backends/base.py`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from cubeaccel.backends import nvidia
from cubeaccel.backends.base import AttachSpec, HostPreparation, Problem, ResetContext, ResetResult
from cubeaccel.backends.vfio_spec import DeviceSpec, accelerator_class, parse_allow
from cubeaccel.host.pci.base import Holder, HostError, PciFunction, PciHost, SupportsBusReach, SupportsRestore
from cubeaccel.host.pci.readiness import HostRoots, check_host
from cubeaccel.host.pci.snapshot import SnapshotHost
from cubeaccel.host.vmm.confine import take_back
from cubeaccel.model.device import DeviceRecord, DiscoveredDevice, PciAddress
from cubeaccel.model.profiles import labels_for
from cubeaccel.model.reset_ladder import Reached, ResetAttempt, ResetFacts, ResetStep, Rung, next_step
from cubeaccel.model.states import DeviceState

VFIO_DRIVER = "vfio-pci"
# Reset methods the kernel may use between tenants. `bus` (secondary bus reset) also resets every
# other function behind the same bridge; drop it when GPUs share a bridge with anything else.
DEFAULT_RESET_METHODS: frozenset[str] = frozenset({"flr", "af", "pm", "bus", "device_specific", "cxl_bus"})

Device = DeviceRecord | DiscoveredDevice


class VfioBackend:
    """Discovers accelerators, keeps them bound to vfio-pci, checks groups/holders, resets between tenants."""

    name = "vfio"
    expected_driver = VFIO_DRIVER

    def __init__(
        self,
        host: PciHost,
        allow: Sequence[str] = ("10de:*",),
        *,
        reset_methods: Iterable[str] = DEFAULT_RESET_METHODS,
        clock: Callable[[], float] = time.monotonic,
        readiness_roots: HostRoots | None = None,
    ) -> None:
        """`readiness_roots`: where `cubeaccel host check` looks (sysfs, /dev, /proc). None only for a simulated
        host, which models a kernel with an IOMMU and vfio-pci; a real (or fake-tree) host always passes them."""
        self._host = host
        self._pass = threading.local()  # the snapshot of the reconcile pass running in this thread, if any
        self._restorer = host if isinstance(host, SupportsRestore) else None  # a host capability, asked once
        self._reach = host if isinstance(host, SupportsBusReach) else None  # without it: no bus rung
        self.readiness_roots = readiness_roots
        self.specs: tuple[DeviceSpec, ...] = parse_allow(list(allow))
        self.allow = tuple(str(s) for s in self.specs)
        self.reset_methods = frozenset(reset_methods)
        self._clock = clock
        self._aer_baseline: dict[PciAddress, int] = {}

    @property
    def host(self) -> PciHost:
        snap: SnapshotHost | None = getattr(self._pass, "host", None)
        return self._host if snap is None else snap

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        """This thread's host reads come from one snapshot until the block ends (a write drops it); other
        threads — a release resetting a device meanwhile — read the host itself."""
        if getattr(self._pass, "host", None) is not None:
            yield
            return
        self._pass.host = SnapshotHost(self._host)
        self._pass.fabric = None
        try:
            yield
        finally:
            self._pass.host = None
            self._pass.fabric = None

    # ---- host readiness ---------------------------------------------------------------------------
    def readiness(self) -> list[Problem]:
        """`cubeaccel host check`'s failures: passthrough cannot work here (no IOMMU, PVM, no IR, no vfio)."""
        if self.readiness_roots is None:
            return []
        r = self.readiness_roots
        return [Problem(c.code, c.reason) for c in check_host(r.sys, r.dev, r.proc).failures]

    # ---- discovery ------------------------------------------------------------------------------
    def discover(self) -> list[DiscoveredDevice]:
        found = []
        for f in self.host.functions():
            cls = accelerator_class(f, self.specs)
            if cls is None:
                continue
            labels = labels_for(f.vendor_id, f.device_id)
            labels.update(backend=self.name, numa_node=str(f.numa_node), **{"class": cls.value})
            found.append(
                DiscoveredDevice(
                    address=f.address,
                    identity=f.identity,
                    accel_class=cls,
                    backend=self.name,
                    numa_node=f.numa_node,
                    iommu_group=f.iommu_group,
                    driver=f.driver,
                    labels=labels,
                )
            )
        return found

    # ---- host preparation -----------------------------------------------------------------------
    def prepare(self, device: Device) -> HostPreparation:
        """Bind the device to vfio-pci unless it already is; refuse while anyone holds it open."""
        f = self.host.function(device.address)
        if f is None:
            return HostPreparation(device.address, None, False, [_missing(device.address)])
        held = self._vendor_holds(f)
        if held:
            return HostPreparation(device.address, f.driver, False, held)  # never rebound to vfio-pci
        if f.driver == VFIO_DRIVER:
            return HostPreparation(device.address, f.driver, False)
        problems = []
        if not self.host.driver_available(VFIO_DRIVER):
            problems.append(Problem("backend.vfio_unavailable", "vfio-pci driver is not available on this host"))
        if f.extra.get("boot_vga") == "1":
            problems.append(Problem("backend.boot_vga", f"{f.address} drives the host console; not unbinding it"))
        if f.iommu_group is None:
            # vfio-pci's probe would fail (-22) after the device was already unbound from its driver
            problems.append(
                Problem(
                    "backend.no_iommu_group",
                    f"{f.address} has no iommu_group: vfio-pci cannot bind a device no IOMMU covers "
                    "(enable VT-d/AMD-Vi in firmware, boot with intel_iommu=on)",
                )
            )
        holders = self.host.holders(device.address)
        if holders:
            problems.append(_held(f.address, holders))
        if problems:
            return HostPreparation(device.address, f.driver, False, problems)
        try:
            self.host.bind(device.address, VFIO_DRIVER)
        except HostError as e:
            return HostPreparation(device.address, f.driver, True, [Problem("backend.bind_failed", e.message)])
        return HostPreparation(device.address, f.driver, True)

    def restore_host(self, device: Device, original_driver: str | None) -> list[Problem]:
        """Hand the device back to its original host driver (None: leave it unbound)."""
        f = self.host.function(device.address)
        if f is None:
            return [_missing(device.address)]
        holders = self.host.holders(device.address)
        if holders:
            return [_held(f.address, holders)]
        try:
            if self._restorer is not None:
                self._restorer.restore_driver(device.address, original_driver)
            elif original_driver is not None:
                self.host.bind(device.address, original_driver)
            else:
                return [Problem("backend.restore_unsupported", "this host cannot leave a device unbound")]
        except HostError as e:
            return [Problem("backend.restore_failed", e.message)]
        return []

    # ---- checks ---------------------------------------------------------------------------------
    def _vendor_holds(self, f: PciFunction) -> list[Problem]:
        """Devices this release cannot serve on this host although they are sound (held, not failed): NVIDIA GPUs
        on an NVSwitch fabric."""
        if f.vendor_id != nvidia.NVIDIA_VENDOR:
            return []
        p = self._fabric().problem(f)
        return [p] if p is not None else []

    def _fabric(self) -> nvidia.Fabric:
        """The host's NVSwitch fabric: a host-wide fact, so one listing of the bus per pass, not one per device
        (host initialization asks for every device twice, in `prepare` and `validate`). Binding a device to
        vfio-pci changes no function's vendor or class, so the pass's answer holds until it ends; outside a pass
        (a release's revalidation) it is read each time."""
        cached: nvidia.Fabric | None = getattr(self._pass, "fabric", None)
        if cached is not None:
            return cached
        fabric = nvidia.Fabric.of(self.host.functions())
        if getattr(self._pass, "host", None) is not None:
            self._pass.fabric = fabric
        return fabric

    def _presence(self, device: Device) -> tuple[PciFunction | None, list[Problem]]:
        f = self.host.function(device.address)
        if f is None:
            return None, [_missing(device.address)]
        if f.identity != device.identity:
            return f, [
                Problem(
                    "host.identity_changed",
                    f"{device.address} is now {_describe(f)}, was {device.identity.vendor_device}"
                    + (f" serial {device.identity.serial}" if device.identity.serial else ""),
                )
            ]
        return f, []

    def group_offenders(self, f: PciFunction) -> list[str]:
        """Functions of `f`'s IOMMU group that keep it from being viable (bridges excepted)."""
        if f.iommu_group is None:
            return []
        offenders = []
        for member in self.host.iommu_group_members(f.iommu_group):
            if member == f.address:
                continue
            mf = self.host.function(member)
            if mf is None or mf.is_bridge:
                continue
            if mf.driver not in (VFIO_DRIVER, None):
                offenders.append(f"{member}({mf.driver})")
        return offenders

    def _group_problems(self, f: PciFunction) -> list[Problem]:
        if f.iommu_group is None:
            return [Problem("backend.no_iommu_group", f"{f.address} has no IOMMU group (is the IOMMU on?)")]
        offenders = self.group_offenders(f)
        if offenders:
            return [
                Problem(
                    "backend.iommu_group_not_viable",
                    f"IOMMU group {f.iommu_group} has functions not bound to vfio-pci: {', '.join(offenders)}",
                )
            ]
        return []

    def _answers(self, address: PciAddress) -> list[Problem]:
        if self.host.config_vendor_id(address) == 0xFFFF:
            return [Problem("host.device_not_responding", f"{address} config space reads 0xffff")]
        return []

    def aer_baseline(self, address: PciAddress) -> int:
        """Fatal AER count accepted so far; 0 when none is known (Cubelet persists and seeds these)."""
        return self._aer_baseline.get(address, 0)

    def aer_baselines(self) -> dict[PciAddress, int]:
        return dict(self._aer_baseline)

    def set_aer_baseline(self, address: PciAddress, count: int) -> None:
        self._aer_baseline[address] = count

    def accept_aer(self, address: PciAddress) -> int | None:
        """An operator's `recover` acknowledges the errors seen so far: the current count becomes the baseline."""
        f = self.host.function(address)
        if f is None or f.aer_fatal is None:
            return None
        self._aer_baseline[address] = f.aer_fatal
        return f.aer_fatal

    def _aer_problems(self, f: PciFunction) -> list[Problem]:
        base = self.aer_baseline(f.address)
        if f.aer_fatal is not None and f.aer_fatal > base:
            return [Problem("host.aer_fatal", f"{f.address} reported {f.aer_fatal - base} new fatal AER error(s)")]
        return []

    def validate(self, device: DeviceRecord) -> list[Problem]:
        """Everything `initialized → allocatable` needs. A fatal AER count above the known baseline fails it;
        the first time a device is seen, a passing validation records its count as the baseline."""
        f, problems = self._presence(device)
        if f is None or problems:
            return problems
        held = self._vendor_holds(f)
        if held:
            return held
        if not f.enabled:
            problems.append(Problem("host.device_disabled", f"{f.address} is in an error state"))
        if f.driver != VFIO_DRIVER:
            problems.append(Problem("backend.wrong_driver", f"{f.address} bound to {f.driver}, not vfio-pci"))
        problems += self._group_problems(f)
        holders = self.holders(device)
        if holders:
            problems.append(_held(f.address, holders))
        problems += self._answers(device.address)
        if f.address in self._aer_baseline:
            problems += self._aer_problems(f)
        elif not problems and f.aer_fatal is not None:
            self._aer_baseline[f.address] = f.aer_fatal
        return problems

    def health(self, device: DeviceRecord) -> list[Problem]:
        """Same address, same identity, expected driver, AER fatal count unchanged, answering, no stray holder."""
        f, problems = self._presence(device)
        if f is None or problems:
            return problems
        expected = device.expected_driver or VFIO_DRIVER
        if f.driver != expected:
            problems.append(Problem("backend.wrong_driver", f"{f.address} bound to {f.driver}, not {expected}"))
        if not f.enabled:
            problems.append(Problem("host.device_disabled", f"{f.address} is in an error state"))
        problems += self._aer_problems(f)
        problems += self._answers(device.address)
        if device.state not in (DeviceState.ATTACHED, DeviceState.PREPARING):
            holders = self.holders(device)
            if holders:
                held = _held(f.address, holders)
                problems.append(Problem("host.unexpected_holder", held.message, hard=False))
        return problems

    def holders(self, device: Device) -> list[Holder]:
        return self.host.holders(device.address)

    def wait_released(self, device: Device, timeout_s: float, poll_s: float = 0.05) -> list[Problem]:
        """Poll until nobody holds the device's files, up to `timeout_s`. A holder that stays → soft problem."""
        deadline = self._clock() + timeout_s
        while True:
            holders = self.holders(device)
            if not holders:
                return []
            if self._clock() >= deadline:
                return [_held(device.address, holders)]
            time.sleep(poll_s)

    # ---- cleanup between tenants: the reset ladder (model/reset_ladder.py) ------------------------
    def cleanup(self, device: DeviceRecord) -> list[Problem]:
        """Reset through the ladder, then prove the device still answers as the same device. Soft on failure."""
        return self.reset_ladder(device, ResetContext()).problems

    def reset_ladder(self, device: DeviceRecord, context: ResetContext) -> ResetResult:
        """Rung by rung as `next_step` says, each followed by the post-reset identity and health check; the first
        rung whose check passes ends it. Nothing passed → soft problems (quarantine), naming what was refused."""
        f, problems = self._presence(device)
        if f is None or problems:
            return ResetResult(problems, [])
        attempts: list[ResetAttempt] = []
        tried: set[Rung] = set()
        last: list[Problem] = []
        while True:
            step = next_step(self._reset_facts(f, context, tried))
            if step.rung is Rung.QUARANTINE:
                attempts.append(ResetAttempt(step))
                return ResetResult(_ladder_problems(step, last), attempts)
            try:
                self.host.reset(device.address, step.methods)
            except HostError as e:
                if e.code == "host.no_reset_method":  # the kernel offers no reset at all (no `reset` attribute)
                    attempts.append(ResetAttempt(step, ("backend.no_reset_method",)))
                    return ResetResult([Problem("backend.no_reset_method", e.message, hard=False)], attempts)
                last = [Problem("backend.reset_failed", e.message, hard=False)]
            else:
                last = self._post_reset_check(device)
            attempts.append(ResetAttempt(step, tuple(p.code for p in last)))
            if not last or any(p.hard for p in last):  # a hard finding (new fatal AER) ends it: unhealthy
                return ResetResult(last, attempts)
            tried.add(step.rung)

    def _reset_facts(self, f: PciFunction, context: ResetContext, tried: set[Rung]) -> ResetFacts:
        addresses = self._reach.bus_reach(f.address) if self._reach is not None else None
        reach = None if addresses is None else tuple(self._reached(a, f, context) for a in addresses)
        return ResetFacts(
            address=str(f.address),
            iommu_group=f.iommu_group,
            methods=f.reset_method,
            allowed=self.reset_methods,
            reach=reach,
            prefer_bus=nvidia.prefers_bus_reset(f, context.unclean_exit),
            function_tried=Rung.FUNCTION in tried,
            bus_tried=Rung.BUS in tried,
        )

    def _reached(self, address: PciAddress, device: PciFunction, context: ResetContext) -> Reached:
        """One function a bus reset would reach, with why it is busy (None: idle). The device itself was checked
        by the release rules (no holder) before its reset."""
        other = self.host.function(address)
        if other is None:
            return Reached(str(address), None, "vanished")
        if address == device.address:
            return Reached(str(address), other.iommu_group)
        busy: str | None = context.reserved.get(address)
        if busy is None:
            holders = self.host.holders(address)
            if holders:
                busy = "held by " + ", ".join(f"{h.pid}({h.command})" for h in holders)
            elif other.driver not in (VFIO_DRIVER, None):
                busy = f"bound to {other.driver}"
            elif other.extra.get("enable_count", "0") != "0":
                busy = f"enabled by {other.extra['enable_count']} user(s)"
        return Reached(str(address), other.iommu_group, busy)

    def _post_reset_check(self, device: DeviceRecord) -> list[Problem]:
        """What gates `allocatable` after a rung: config space answers, the same ids (vendor, device, subsystem,
        class, revision, serial), the BARs as recorded, nobody enabled it, no error state, no new fatal AER."""
        if self.host.config_vendor_id(device.address) == 0xFFFF:
            return [Problem("backend.reset_failed", f"{device.address} stopped answering after reset", hard=False)]
        after, problems = self._presence(device)
        if after is None or problems:
            return [Problem(p.code, p.message, hard=False) for p in problems]
        recorded = device.identity.bars
        if recorded and tuple(after.bars) != tuple(recorded):
            now = ", ".join(b.name for b in after.bars) or "none"
            problems.append(
                Problem(
                    "backend.reset_check_failed",
                    f"{device.address} BARs after reset ({now}) differ from those recorded",
                    hard=False,
                )
            )
        enable = after.extra.get("enable_count", "0")
        if enable != "0":
            msg = f"{device.address} enable reads {enable} after reset: something enabled it"
            problems.append(Problem("backend.reset_check_failed", msg, hard=False))
        if not after.enabled:
            problems.append(Problem("backend.reset_check_failed", f"{device.address} is in an error state", hard=False))
        return problems + self._aer_problems(after)  # hard: new fatal errors are not for a reset to clear

    def attach_spec(self, device: DeviceRecord) -> AttachSpec:
        return AttachSpec(driver=VFIO_DRIVER, properties={"host": str(device.address)})

    def reclaim_nodes(self, device: DeviceRecord) -> list[Problem]:
        """The group node the shim handed to the VMM's uid (host/vmm/confine.py), back to root:root 0600. A host
        without device nodes (simulated) has nothing to take back."""
        dev_root = getattr(self._host, "dev_root", None)
        group = device.iommu_group
        if not isinstance(dev_root, Path) or group is None:
            return []
        why = take_back(dev_root / "vfio" / str(group))
        return [Problem("release.device_node_not_returned", why, hard=False)] if why else []


def _ladder_problems(step: ResetStep, last: list[Problem]) -> list[Problem]:
    """The ladder's verdict: a refused bus rung names the functions; otherwise what the last rung's check found."""
    assert step.code is not None
    if last and step.code not in ("backend.bus_reset_refused", "backend.reset_not_allowed"):
        return [Problem(p.code, f"{p.message} ({step.reason})", hard=False) for p in last]
    detail = f" (the last rung's check: {'; '.join(p.message for p in last)})" if last else ""
    return [Problem(step.code, step.reason + detail, hard=False)]


def _missing(address: PciAddress) -> Problem:
    return Problem("host.device_missing", f"no PCI function at {address}")


def _held(address: PciAddress, holders: list[Holder]) -> Problem:
    who = ", ".join(f"{h.pid}({h.command}:{h.path})" for h in holders)
    return Problem("host.device_held", f"{address} is held by {who}", hard=False)


def _describe(f: PciFunction) -> str:
    return f.identity.vendor_device + (f" serial {f.serial}" if f.serial else "")
