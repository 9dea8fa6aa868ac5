"""Builds a real Cubelet (real SQLite store, real VFIO backend logic) on the simulated host."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cubeaccel.backends.base import AttachSpec, Problem
from cubeaccel.backends.scrub_methods import ScrubMethod
from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.cubelet.inventory import initialize_host
from cubeaccel.cubelet.lifecycle import Cubelet, CubeletConfig
from cubeaccel.cubelet.reconcile import Repair, reconcile
from cubeaccel.cubelet.release import StatusSink
from cubeaccel.cubelet.runtime import assemble
from cubeaccel.cubelet.scrub import ScrubImageCheck, ScrubOutcome, ScrubRunner, SimulatedScrubRunner
from cubeaccel.cubelet.shim_driver import SimulatedShimDriver
from cubeaccel.cubelet.store import Store
from cubeaccel.host.pci.simulated import SimulatedPciHost
from cubeaccel.host.service.audit import AuditLog
from cubeaccel.model.device import DeviceRecord, PciAddress
from cubeaccel.model.states import DeviceState
from cubeaccel.wire.master_api import StatusBody


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


class ScrubStandIn:
    """The node's scrub runner, built into its Cubelet once: a test puts the runner it scripts behind it
    (`node.scrub.runner = …`) instead of reaching into the Cubelet. An image check is the runner's, if it has one."""

    def __init__(self, runner: ScrubRunner) -> None:
        self.runner = runner

    @property
    def inline(self) -> bool:
        return self.runner.inline

    def run(self, device: DeviceRecord, attach: AttachSpec, timeout_s: float) -> ScrubOutcome:
        return self.runner.run(device, attach, timeout_s)

    def image_problem(self, method: ScrubMethod) -> Problem | None:
        return self.runner.image_problem(method) if isinstance(self.runner, ScrubImageCheck) else None


class StatusTap:
    """The node's status sink: what the Cubelet tells CubeMaster goes to `sink`, when a test sets one."""

    def __init__(self) -> None:
        self.sink: StatusSink | None = None

    def __call__(self, sandbox_id: str, status: StatusBody) -> None:
        if self.sink is not None:
            self.sink(sandbox_id, status)


@dataclass
class Node:
    """One simulated node; `restart()` models a Cubelet crash: new process, same disk and hardware."""

    dir: Path
    profile: str
    clock: Clock
    host: SimulatedPciHost
    shim: SimulatedShimDriver
    cubelet: Cubelet
    config: CubeletConfig
    audit: AuditLog | None = None  # device custody and host changes, from the first event (None: not audited)
    scrub: ScrubStandIn = field(default_factory=lambda: ScrubStandIn(SimulatedScrubRunner()))
    status: StatusTap = field(default_factory=StatusTap)

    @classmethod
    def create(
        cls, dir: Path, profile: str = "h100x8", config: CubeletConfig | None = None, audit: AuditLog | None = None
    ) -> Node:
        clock = Clock()
        cfg = config or CubeletConfig(reservation_ttl_s=60, release_timeout_s=10, pinnable_memory_mib=1 << 20)
        host = SimulatedPciHost(profile, dir / "host.json")
        node = cls(dir, profile, clock, host, SimulatedShimDriver(host), None, cfg, audit)  # type: ignore[arg-type]
        node.cubelet = node._build()
        initialize_host(node.cubelet)
        assert reconcile(node.cubelet) == []
        return node

    def _build(self) -> Cubelet:
        store = Store(self.dir / "cubelet.db", clock=self.clock)
        backend = VfioBackend(self.host, allow=("10de:*", "1234:11e8"))
        return assemble(
            store, backend, self.shim, self.config, scrub_runner=self.scrub, audit=self.audit, status_sink=self.status
        )

    def restart(self) -> list[Repair]:
        self.cubelet.store.close()
        self.host = SimulatedPciHost(self.profile, self.dir / "host.json")
        old = self.shim
        self.shim = SimulatedShimDriver(
            self.host,
            fail_attach=old.fail_attach,
            uncooperative_guest=old.uncooperative_guest,
            immortal_vmm=old.immortal_vmm,
            failed_guest_validation=old.failed_guest_validation,
        )
        self.scrub, self.status = ScrubStandIn(SimulatedScrubRunner()), StatusTap()  # the new process's own
        self.cubelet = self._build()
        initialize_host(self.cubelet)
        return reconcile(self.cubelet)

    def devices(self) -> list[DeviceRecord]:
        return self.cubelet.store.devices()

    def states(self) -> dict[str, DeviceState]:
        return {d.id: d.state for d in self.devices()}

    def device(self, device_id: str) -> DeviceRecord:
        d = self.cubelet.store.device(device_id)
        assert d is not None
        return d

    def address(self, device_id: str) -> PciAddress:
        return self.device(device_id).address

    def kinds(self, sandbox_id: str | None = None) -> list[str]:
        return [e.kind for e in self.cubelet.store.events() if sandbox_id is None or e.sandbox_id == sandbox_id]

    def repairs(self) -> list[str]:
        return [str(e.details.get("what")) for e in self.cubelet.store.events() if e.kind == "reconcile_repair"]
